"""The bounds of `driver.observability.bounded_http` (its module docstring says what
each one stops) and the counters of what it did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MAX_REQUEST_HEAD: Final = 8190  # the parser's limit on the request line and on one header
MAX_HEADERS: Final = 64


@dataclass(frozen=True)
class Limits:
    """The bounds described in `driver.observability.bounded_http`'s docstring."""

    timeout: float = 5.0
    max_connections: int = 64
    workers: int = 2
    max_body: int = 0
    max_buffered: int = 16 << 20
    small_request: int = 64 << 10
    large_workers: int = 1
    keep_alive: bool = False
    max_per_peer: int = 32
    max_queued: int = 16
    max_queued_large: int = 4

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.max_connections < 1 or self.workers < 1:
            raise ValueError("timeout, max_connections and workers must be positive")
        if self.max_body < 0 or self.max_buffered < 1 or self.large_workers < 1:
            raise ValueError("max_body must be >= 0, max_buffered and large_workers positive")
        if min(self.max_per_peer, self.max_queued, self.max_queued_large) < 1:
            raise ValueError("max_per_peer, max_queued and max_queued_large must be positive")


@dataclass
class HttpStats:
    accepted: int = 0
    answered: int = 0
    timed_out: int = 0  # closed at their deadline
    evicted: int = 0  # closed while sending or idle, to make room for a new connection
    refused: int = 0  # new ones closed at once: a limit was reached, none evictable
    bad_requests: int = 0  # the parser refused the head (answered 400 and closed)
    busy: int = 0  # answered 503 at once: their worker queue or the body budget was full
    failed: int = 0  # answered 500: the handler raised (a bug, never a client's fault)
