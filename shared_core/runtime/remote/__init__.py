"""Served models: :class:`RemoteLM` talks token ids to a vLLM or SGLang server.

Needs the ``remote`` extra (``httpx``); names load lazily, so importing the package is free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared_core.util._lazy import lazy_dir, lazy_getattr

if TYPE_CHECKING:
    from shared_core.runtime.remote.config import RemoteConfig
    from shared_core.runtime.remote.http import RemoteError
    from shared_core.runtime.remote.lm import Capabilities, RemoteCapabilityError, RemoteLM
    from shared_core.runtime.remote.protocol import Generation, RemoteProtocolError

_LAZY = {
    "RemoteLM": "shared_core.runtime.remote.lm",
    "Capabilities": "shared_core.runtime.remote.lm",
    "RemoteCapabilityError": "shared_core.runtime.remote.lm",
    "RemoteConfig": "shared_core.runtime.remote.config",
    "RemoteError": "shared_core.runtime.remote.http",
    "Generation": "shared_core.runtime.remote.protocol",
    "RemoteProtocolError": "shared_core.runtime.remote.protocol",
}
__all__ = ["Capabilities", "Generation", "RemoteCapabilityError", "RemoteConfig", "RemoteError",
           "RemoteLM", "RemoteProtocolError"]
__getattr__ = lazy_getattr(__name__, _LAZY, globals(), install_hint="the remote extra (pip install "
                           "'specrag[remote]')")
__dir__ = lazy_dir(_LAZY, globals())
