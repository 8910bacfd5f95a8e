"""Token-level engines by name, with one calling convention (what the chat/LLM adapters use).

Every registered function has the signature::

    fn(lm, prompt, *, max_new_tokens, documents=None, stop=None, temperature=0.0, top_k=0,
       top_p=1.0, seed=None, engine_state=None, **engine_options) -> TokenStream

``documents`` are texts the engine may draft from (ReSpec) or treat as the long context
(RAPID); engines that do not use them ignore them. ``engine_state`` is a dict the caller keeps
between calls (each adapter instance keeps one); an engine may cache reusable state in it
(RAPID: its decoders with the long context's KV; ReSpec: its decoders with their corpus index),
so that state lives exactly as long as the caller, never in a module-level cache that would keep
models alive (RAPID finds the decoders other callers hold through weak references only).
:func:`check_engine_options` checks an engine's options before any model loads. Modules are
imported on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shared_core.config import check_kwargs
from shared_core.token_config import RAPID_OPTIONS, RESPEC_OPTIONS, RapidConfig, ReSpecConfig

if TYPE_CHECKING:
    from shared_core.engines.loop import Prompt, TokenStream
    from shared_core.models import LM

TOKEN_ENGINES: dict[str, str] = {
    "autoregressive": "shared_core.engines.baseline:stream_autoregressive_engine",
    "respec": "shared_core.engines.respec:stream_respec",
    "rapid": "shared_core.engines.rapid:stream_rapid",
}

# per engine: its config (None: none) and its other options; every engine takes a logits_mask
ENGINE_OPTIONS: dict[str, tuple[type | None, tuple[str, ...]]] = {
    "autoregressive": (None, ("cache",)),
    "respec": (ReSpecConfig, RESPEC_OPTIONS),
    "rapid": (RapidConfig, RAPID_OPTIONS),
}


def check_engine_name(name: str) -> str:
    """``name`` if it is a registered token engine, else a ValueError naming the choices (a
    TypeError for a non-string)."""
    if not isinstance(name, str):
        msg = f"engine must be a str, one of {sorted(TOKEN_ENGINES)}; got {type(name).__name__} {name!r:.60}"
        raise TypeError(msg)
    if name not in TOKEN_ENGINES:
        msg = f"engine={name!r} is not one of {sorted(TOKEN_ENGINES)}"
        raise ValueError(msg)
    return name


def check_engine_options(name: str, options: Any) -> dict[str, Any]:
    """``options`` if engine ``name`` takes them, checked without importing torch or touching a
    model: an unknown key is a TypeError naming it and the closest valid one, a bad config value
    the config's own TypeError / ValueError naming the field."""
    config, others = ENGINE_OPTIONS[check_engine_name(name)]
    if not isinstance(options, dict):
        msg = f"engine_options must be a dict, got {type(options).__name__}"
        raise TypeError(msg)
    fields = {f.name for f in dataclasses.fields(config)} if config is not None else set()
    check_kwargs(options, fields | {*others, "logits_mask"}, f"engine={name!r} (engine_options)")
    if config is not None:
        config(**{key: value for key, value in options.items() if key in fields})
    return options


def engine_function(name: str) -> Callable[..., TokenStream]:
    module, attr = TOKEN_ENGINES[check_engine_name(name)].split(":")
    return getattr(importlib.import_module(module), attr)


def stream_engine(name: str, lm: LM, prompt: Prompt, *, max_new_tokens: int,
                  documents: Sequence[str] | None = None,
                  engine_state: dict[str, Any] | None = None, **options: Any) -> TokenStream:
    """Start a generation with the named engine; iterate the stream for text deltas."""
    return engine_function(name)(lm, prompt, max_new_tokens=max_new_tokens,
                                 documents=documents, engine_state=engine_state, **options)
