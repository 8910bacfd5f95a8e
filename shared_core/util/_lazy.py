"""PEP 562 lazy attributes: a package names its public classes without importing their modules
(``__getattr__`` imports one on first access, ``__dir__`` lists them all)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str], namespace: dict[str, Any],
                 install_hint: str | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` importing ``names[attr]`` on first access and caching the value."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        try:
            module = importlib.import_module(names[name])
        except ImportError as e:
            if install_hint is None:
                raise
            msg = f"{name} needs {install_hint} ({e})"
            raise ImportError(msg) from e
        value = getattr(module, name)
        namespace[name] = value
        return value

    return __getattr__


def lazy_dir(names: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[], list[str]]:
    """A module ``__dir__`` (PEP 562) listing the lazy names before their first access too, so
    ``dir()`` and tab completion show what ``__getattr__`` serves."""

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __dir__
