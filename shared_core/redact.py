"""Credentials never leave the process: one redaction for messages, logs, reprs and pickles.

Standard library only (layer 0), so every layer that may echo a URL, a header or a server's
answer can use it. Covered: the user-info of URLs (``http://user:secret@host`` becomes
``http://***@host``), secret-looking query parameters and ``key=value`` pairs (``api_key=``,
``token=``, ``password=`` ...), ``Authorization`` header values and bearer tokens, and every value
registered with :func:`register_secret` (API keys and URL passwords a client was given), wherever
it appears, e.g. echoed back in a server's error body.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
EXCERPT_CHARS = 200  # the most of a server's answer an error message quotes
_MIN_SECRET = 4  # shorter values are too common to replace everywhere

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@'\"<>]*@")
_AUTH_HEADER = re.compile(r"(?P<name>\bauthorization\b['\"]?\s*[:=]\s*['\"]?)"
                          r"(?:(?:bearer|basic|token)\s+)?[^\s'\",}]+", re.IGNORECASE)
_BEARER = re.compile(r"(?P<name>\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
_KEY_VALUE = re.compile(
    r"(?P<name>\b[\w-]*(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|token|secret|"
    r"password|passwd|pwd|[_-]key)['\"]?\s*[:=]\s*['\"]?)(?P<value>[^\s&'\",;}]+)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")

_known: set[str] = set()
_known_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Redact ``value`` wherever it appears from now on (an API key, a URL's password)."""
    if isinstance(value, str) and len(value) >= _MIN_SECRET:
        with _known_lock:
            _known.add(value)


def redact(text: object) -> str:
    """``str(text)`` with every credential replaced by ``***``."""
    out = str(text)
    with _known_lock:
        known = sorted(_known, key=len, reverse=True)  # longest first: no partial leftovers
    for secret in known:
        out = out.replace(secret, MASK)
    out = _USERINFO.sub(rf"\g<scheme>{MASK}@", out)
    out = _AUTH_HEADER.sub(rf"\g<name>{MASK}", out)
    out = _BEARER.sub(rf"\g<name>{MASK}", out)
    return _KEY_VALUE.sub(rf"\g<name>{MASK}", out)


def excerpt(text: object, limit: int = EXCERPT_CHARS) -> str:
    """A short, one-line, redacted quote of a server's answer for an error message."""
    flat = " ".join(_CONTROL.sub(" ", redact(text)).split())
    return flat if len(flat) <= limit else f"{flat[: limit - 1]}…"


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``(url without user-info, (user, password) or None)``; the password is registered."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    register_secret(parts.password)
    return (urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)),
            (parts.username or "", parts.password or ""))


def strip_credentials(value: object) -> object:
    """A URL string without its user-info (what pickles keep), a URL's user-info inside other
    text masked, also inside plain lists, tuples and dicts (a copy); anything else unchanged."""
    if isinstance(value, str) and "://" in value and "@" in value:
        if value.split() != [value]:  # text around a URL: mask the user-info in place
            return _USERINFO.sub(rf"\g<scheme>{MASK}@", value)
        try:
            return split_credentials(value)[0]
        except ValueError:  # not a URL after all (a bad port): redact instead
            return redact(value)
    if type(value) in (list, tuple):  # exact types: a subclass may not rebuild from a list
        return type(value)(strip_credentials(item) for item in value)  # type: ignore[call-arg]
    if type(value) is dict:
        return {key: strip_credentials(item) for key, item in value.items()}  # type: ignore[attr-defined]
    return value


class _Shown:
    """A value's redacted repr, for ``__repr_args__`` (pydantic shows ``repr()`` of each)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def redacted_repr_args(pairs: Iterable[tuple[str | None, Any]]) -> list[tuple[str | None, Any]]:
    """pydantic ``__repr_args__`` with every credential in a value's repr redacted."""
    out: list[tuple[str | None, Any]] = []
    for name, value in pairs:
        shown = repr(value)
        hidden = redact(shown)
        out.append((name, value if hidden == shown else _Shown(hidden)))
    return out
