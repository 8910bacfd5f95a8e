"""Credentials never leave the process: one redaction for messages, logs, reprs and pickles.

Standard library only (layer 0), so every layer that may echo a URL, a header or a server's
answer can use it. Covered: the user-info of URLs (``http://user:secret@host`` becomes
``http://***@host``), credential query parameters (``?key=``, ``sig=``, ``signature=``,
``X-Amz-Signature=``, ``X-Amz-Credential=``, ``access_token=`` ...: :func:`is_secret_name`),
secret-looking ``key=value`` pairs in any text (``api_key=``, ``token=``, ``password=`` ...),
``Authorization`` header values and bearer tokens, and every value registered with
:func:`register_secret` (API keys, URL passwords and query credentials a client was given),
wherever it appears, e.g. echoed back in a server's error body.

Where a setting leaves the process: ``str`` / ``repr`` of errors and logs use :func:`redact`;
pickles keep a URL without its credentials (:func:`strip_credentials`); pydantic dumps
(``model_dump``, ``model_dump_json``, ``dict``, ``json``, LlamaIndex ``to_dict`` / ``to_json``)
mask them (:func:`redacted_dump`); :class:`RedactingFilter` masks third-party log records
(httpx logs each request's full URL).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from typing import Any, overload
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
EXCERPT_CHARS = 200  # the most of a server's answer an error message quotes
_MIN_SECRET = 4  # shorter values are too common to replace everywhere

# greedy up to the last "@" of the authority: an unencoded "@" in a password is still masked
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/?#\s'\"<>]*@")
_AUTH_HEADER = re.compile(r"(?P<name>\bauthorization\b['\"]?\s*[:=]\s*['\"]?)"
                          r"(?:(?:bearer|basic|token)\s+)?[^\s'\",}]+", re.IGNORECASE)
_BEARER = re.compile(r"(?P<name>\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
# names that hold a credential wherever they appear (``X-Amz-Signature``, ``client_secret`` ...)
_SECRET_WORDS = (r"[\w-]*(?:api[_-]?key|apikey|access[_-]?token|auth[_-]?token|token|secret|"
                 r"password|passwd|pwd|credentials?|signature|[_-]key)")
# short names that are credentials as URL query parameters (Azure SAS ``sig``, Google ``key``)
_QUERY_WORDS = r"key|sig|auth|pass"
_KEY_VALUE = re.compile(
    rf"(?P<name>\b{_SECRET_WORDS}['\"]?\s*[:=]\s*['\"]?)(?P<value>[^\s&'\",;}}]+)", re.IGNORECASE)
# a URL's credential query parameters (also after "#": OAuth's implicit-flow tokens)
_QUERY_VALUE = re.compile(rf"(?P<name>[?&;#](?:{_SECRET_WORDS}|{_QUERY_WORDS})=)"
                          r"(?P<value>[^\s&#'\",;}]+)", re.IGNORECASE)
_SECRET_NAME = re.compile(rf"{_SECRET_WORDS}|{_QUERY_WORDS}", re.IGNORECASE)
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
    out = redact_urls(str(text))
    out = _AUTH_HEADER.sub(rf"\g<name>{MASK}", out)
    out = _BEARER.sub(rf"\g<name>{MASK}", out)
    return _KEY_VALUE.sub(rf"\g<name>{MASK}", out)


def is_secret_name(name: str) -> bool:
    """Whether a query parameter or header named ``name`` holds a credential."""
    return _SECRET_NAME.fullmatch(name) is not None


def redact_urls(text: str) -> str:
    """``text`` with the credentials of the URLs in it masked (user-info, credential query
    parameters, registered values) and nothing else changed: for settings that may also hold
    prose, such as prompts."""
    with _known_lock:
        known = sorted(_known, key=len, reverse=True)  # longest first: no partial leftovers
    for secret in known:
        text = text.replace(secret, MASK)
    text = _USERINFO.sub(rf"\g<scheme>{MASK}@", text)
    return _QUERY_VALUE.sub(rf"\g<name>{MASK}", text)


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


def query_credentials(query: str) -> list[tuple[str, str]]:
    """A query string's parameters in order, the values of credential ones registered."""
    pairs = parse_qsl(query, keep_blank_values=True)
    for name, value in pairs:
        if is_secret_name(name):
            register_secret(value)
    return pairs


def without_credentials(url: str) -> str:
    """``url`` without its user-info and its credential query parameters (what pickles keep)."""
    bare = split_credentials(url)[0]
    parts = urlsplit(bare)
    pairs = query_credentials(parts.query)
    kept = [(name, value) for name, value in pairs if not is_secret_name(name)]
    if len(kept) == len(pairs):
        return bare
    return urlunsplit(parts._replace(query=urlencode(kept)))


def strip_credentials(value: object) -> object:
    """A URL string without its credentials (what pickles keep: :func:`without_credentials`),
    a URL's credentials inside other text masked, also inside plain lists, tuples and dicts (a
    copy); anything else unchanged."""
    if isinstance(value, str) and "://" in value:
        if value.split() != [value]:  # text around a URL: mask its credentials in place
            return redact_urls(value)
        try:
            return without_credentials(value)
        except ValueError:  # not a URL after all (a bad port): redact instead
            return redact(value)
    # exact types: a subclass may not rebuild from a list
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(strip_credentials(item) for item in value)
    if isinstance(value, dict) and type(value) is dict:
        return {key: strip_credentials(item) for key, item in value.items()}
    return value


@overload
def redacted_dump(value: dict[str, Any]) -> dict[str, Any]: ...


@overload
def redacted_dump(value: object) -> object: ...


def redacted_dump(value: object) -> object:
    """A dumped setting (pydantic's ``model_dump`` output) with the credentials of its URLs
    masked, inside plain lists, tuples and dicts too; anything else unchanged."""
    if isinstance(value, str):
        return redact_urls(value)
    if isinstance(value, list | tuple) and type(value) in (list, tuple):
        return type(value)(redacted_dump(item) for item in value)
    if isinstance(value, dict) and type(value) is dict:
        return {key: redacted_dump(item) for key, item in value.items()}
    return value


class RedactingFilter(logging.Filter):
    """Masks credentials in every record of the logger it is added to (a library that logs
    request URLs: httpx), by rewriting the record's message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = redact(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


def redact_logger(name: str) -> None:
    """Add one :class:`RedactingFilter` to the logger ``name`` (idempotent)."""
    target = logging.getLogger(name)
    if not any(isinstance(f, RedactingFilter) for f in target.filters):
        target.addFilter(RedactingFilter())


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
