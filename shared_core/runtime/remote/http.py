"""Pooled sync + async HTTP with timeouts, retries with exponential back-off and auth headers.

Credentials never reach a message, a log line or a repr: a URL's user-info becomes basic auth
(the URL kept is the one without it), API keys and credential query parameters are registered
with :mod:`shared_core.util.redact` (httpx's own request log lines are redacted too), and an error
quotes at most :data:`~shared_core.util.redact.EXCERPT_CHARS` redacted characters of the server's
answer.

A base URL is taken as users write it (:func:`split_base_url`): a path prefix (a proxy's
``/vllm``) is kept, a trailing slash and an OpenAI-style ``/v1`` suffix are dropped (the paths
requested carry their own ``/v1``), and its query parameters (an API gateway's ``?key=``) are
sent with every request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import weakref
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx

from shared_core.runtime.remote.config import API_KEY_ENV, RETRY_STATUSES, RemoteConfig
from shared_core.util.redact import (
    excerpt,
    query_credentials,
    redact,
    redact_logger,
    register_secret,
    split_credentials,
)

logger = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """A request failed for good (after its retries) or the server refused it."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(redact(message))
        self.status = status

    def __reduce__(self) -> tuple[type, tuple[str, int | None]]:
        return type(self), (str(self), self.status)


def _headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    register_secret(key)
    return {"Authorization": f"Bearer {key}"} if key else {}


def split_base_url(url: str) -> tuple[str, list[tuple[str, str]], tuple[str, str] | None]:
    """``(scheme://host[:port][/prefix], query parameters, (user, password) or None)`` of a
    server's base URL as a user wrote it (module docstring); credentials are registered."""
    bare, auth = split_credentials(url.strip())
    parts = urlsplit(bare)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    base = urlunsplit((parts.scheme, parts.netloc, path, "", ""))
    return base, query_credentials(parts.query), auth


def _retryable(exc: Exception | None, response: httpx.Response | None) -> bool:
    if exc is not None:
        return isinstance(exc, httpx.TransportError)  # connect/read errors and timeouts
    return response is not None and response.status_code in RETRY_STATUSES


def _hint(exc: Exception | None, status: int | None) -> str:
    """The setting that changes the outcome, for the errors a user fixes by changing one."""
    if isinstance(exc, httpx.TimeoutException):
        return " (a longer wait: RemoteConfig(timeout_s=...))"
    if status in (401, 403):
        return f" (the server's key: RemoteLM(api_key) or ${API_KEY_ENV})"
    return ""


def _result(method: str, url: str, response: httpx.Response) -> Any:
    status = response.status_code
    if status >= 400:
        msg = f"{method} {url} -> HTTP {status}{_hint(None, status)}: {excerpt(response.text)}"
        raise RemoteError(msg, status)
    if "json" not in response.headers.get("content-type", ""):
        return response.text
    try:
        return response.json()
    except ValueError as e:  # a body cut short (a proxy's timeout) or not JSON at all
        msg = f"{method} {url}: the answer is not valid JSON ({e}): {excerpt(response.text)}"
        raise RemoteError(msg, status) from e


def _failure(method: str, url: str, attempts: int, exc: Exception | None,
             response: httpx.Response | None) -> RemoteError:
    status = None if response is None else response.status_code
    # no exception: there is a response
    why = f"{type(exc).__name__}: {excerpt(exc)}" if exc is not None else \
        f"HTTP {status}: {excerpt(response.text)}"  # type: ignore[union-attr]
    return RemoteError(f"{method} {url} failed after {attempts} attempt(s){_hint(exc, status)}: "
                       f"{why}", status)


class _Retries:
    """One request's retry policy (which outcomes retry, the back-off schedule, the errors);
    the sync and async request methods only send, and sleep for as long as this says."""

    def __init__(self, method: str, url: str, config: RemoteConfig, retries: int | None) -> None:
        self.method, self.url = method, redact(url)
        self.attempts = 1 + (config.max_retries if retries is None else retries)
        self._backoff = config.backoff

    def settle(self, attempt: int, exc: Exception | None, response: httpx.Response | None
               ) -> tuple[bool, Any]:
        """``(True, result)`` once the request is done, ``(False, seconds)`` to wait before the
        next attempt; a RemoteError for an error that does not retry or the last attempt."""
        if not _retryable(exc, response):
            if exc is not None:
                raise RemoteError(f"{self.method} {self.url}: {excerpt(exc)}") from exc
            # no exception: there is a response
            return True, _result(self.method, self.url, response)  # type: ignore[arg-type]
        if attempt + 1 >= self.attempts:
            raise _failure(self.method, self.url, self.attempts, exc, response)
        # no exception: there is a response
        logger.info("retrying %s %s (attempt %d): %s", self.method, self.url, attempt + 1,
                    excerpt(exc) if exc is not None else response.status_code)  # type: ignore[union-attr]
        return False, self._backoff(attempt)


class Transport:
    """One server's connection pools (a sync and, on first use, an async one)."""

    def __init__(self, base_url: str, *, api_key: str | None, config: RemoteConfig,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url, self._params, auth = split_base_url(base_url)
        self.config = config
        redact_logger("httpx")  # it logs every request's URL, query credentials included
        self._kwargs: dict[str, Any] = {
            "base_url": self.base_url, "params": self._params, "headers": _headers(api_key),
            "auth": auth,
            "timeout": httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            "limits": httpx.Limits(max_connections=config.max_connections,
                                   max_keepalive_connections=config.max_connections),
        }
        self._transport = transport
        # the caller passes the transport that fits the client it uses
        self._client = httpx.Client(**self._kwargs, transport=transport)  # type: ignore[arg-type]
        # an async client's connections belong to the event loop that opened them: one per loop
        # (a script calling asyncio.run twice, a notebook, a test per loop)
        self._aclients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = \
            weakref.WeakKeyDictionary()

    def request(self, method: str, path: str, json: object = None, *, retries: int | None = None
                ) -> Any:
        plan = _Retries(method, self.url(path), self.config, retries)
        for attempt in itertools.count():  # settle returns or raises by plan.attempts
            exc, response = None, None
            try:
                response = self._client.request(method, path, json=json)
            except httpx.HTTPError as e:
                exc = e
            done, value = plan.settle(attempt, exc, response)
            if done:
                return value
            time.sleep(value)

    def url(self, path: str) -> str:
        """The full URL a request for ``path`` goes to (query parameters included)."""
        query = f"?{urlencode(self._params)}" if self._params else ""
        return f"{self.base_url}{path}{query}"

    def _async_client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            # the caller passes the transport that fits the client it uses
            client = self._aclients[loop] = httpx.AsyncClient(
                **self._kwargs, transport=self._transport)  # type: ignore[arg-type]
        return client

    async def arequest(self, method: str, path: str, json: object = None, *,
                       retries: int | None = None) -> Any:
        client = self._async_client()
        plan = _Retries(method, self.url(path), self.config, retries)
        for attempt in itertools.count():  # settle returns or raises by plan.attempts
            exc, response = None, None
            try:
                response = await client.request(method, path, json=json)
            except httpx.HTTPError as e:
                exc = e
            done, value = plan.settle(attempt, exc, response)
            if done:
                return value
            await asyncio.sleep(value)

    def __repr__(self) -> str:
        return f"Transport({redact(self.base_url)!r})"

    def __reduce__(self) -> Any:
        msg = "a Transport holds open connections and credentials; it is not picklable"
        raise TypeError(msg)

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        """Close this event loop's async client (another loop's closes with that loop)."""
        client = self._aclients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
