"""Defaults of the served-model client (torch-free; each defined once here).

:class:`RemoteConfig` holds the transport settings of :class:`~shared_core.runtime.remote.lm.RemoteLM`:
timeouts, retries with exponential back-off, connection pooling and the API key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared_core.config import check_config_types, check_int, check_real, check_timeout, require

Engine = Literal["auto", "vllm", "sglang"]
ENGINES: tuple[Engine, ...] = ("auto", "vllm", "sglang")
API_KEY_ENV = "SPECRAG_REMOTE_API_KEY"  # read when no api_key is passed
# HTTP statuses worth retrying: rate limits and a proxy/server that is (re)starting.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RemoteConfig:
    """How :class:`RemoteLM` talks to a server.

    ``timeout_s`` bounds one request (reading a long generation included); ``connect_timeout_s``
    the TCP connect. A failed request (connection error, timeout, or a status in
    :data:`RETRY_STATUSES`) is retried ``max_retries`` times, sleeping ``backoff_s * 2**attempt``
    (at most ``backoff_max_s``). ``max_connections`` caps the pooled connections per client.
    """

    timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    max_connections: int = 16
    probe_text: str = "Speculative decoding: the drafter proposes, the verifier checks 123."

    def __post_init__(self) -> None:
        check_config_types(self)
        check_timeout(self.timeout_s, "timeout_s")
        check_timeout(self.connect_timeout_s, "connect_timeout_s")
        check_int(self.max_retries, "max_retries", 0)
        check_int(self.max_connections, "max_connections")
        for name in ("backoff_s", "backoff_max_s"):
            value = check_real(getattr(self, name), name)
            require(value >= 0, name, ">= 0", value)
        require(bool(self.probe_text.strip()), "probe_text", "a non-empty string", self.probe_text)

    def backoff(self, attempt: int) -> float:
        """Seconds to sleep before retry number ``attempt`` (0-based)."""
        return min(self.backoff_max_s, self.backoff_s * 2.0**attempt)
