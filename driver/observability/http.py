"""The plugin's HTTP endpoint: /metrics for Prometheus, /healthz for the liveness probe,
/readyz for the readiness probe (503 "starting" until `serve_readiness` named its
source: driver.plugin.readiness), /status for `gpu-dra status` (JSON, once
`serve_status` named its source).

The port is reachable from every pod that may talk to the plugin pod, so the server is
bounded against idle and slow clients (`driver.observability.bounded_http`): one I/O
thread for every connection, a deadline of `timeout` seconds (default 5) to deliver the
request head and again to take the answer, at most `max_connections` (default 64) open
(a new one closes the oldest still waiting for its request, so that a flood of idle
connections cannot lock out the probe), `workers` threads (default 2) computing the
answers (the health callback, `generate_latest`). One request per connection
(`Connection: close`), a request head of at most 8 KiB, GET and HEAD only; request
bodies are not read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from driver.observability.bounded_http import BoundedHttpServer, Limits
from driver.observability.http_messages import Request, Response
from driver.observability.metrics import REGISTRY

DEFAULT_TIMEOUT: Final = 5.0
DEFAULT_MAX_CONNECTIONS: Final = 64
DEFAULT_WORKERS: Final = 2

Healthy = Callable[[], tuple[bool, str]]
Status = Callable[[], dict[str, Any]]


class HttpServer(BoundedHttpServer):
    """Serves /metrics and /healthz; see the module docstring for the bounds."""

    def __init__(
        self,
        port: int,
        healthy: Healthy,
        host: str = "",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        self._healthy = healthy
        self._status: Status | None = None
        self._ready: Healthy = _starting
        limits = Limits(timeout=timeout, max_connections=max_connections, workers=workers)
        super().__init__(host, port, self._respond, limits)

    @property
    def timeout(self) -> float:
        return self.limits.timeout

    @property
    def max_connections(self) -> int:
        return self.limits.max_connections

    def serve_status(self, status: Status) -> None:
        """Answer /status with `status()` as JSON from now on (404 before)."""
        self._status = status

    def serve_readiness(self, ready: Healthy) -> None:
        """Answer /readyz from `ready()` from now on (503 "starting" before)."""
        self._ready = ready

    def start(self) -> HttpServer:
        super().start()
        return self

    def _respond(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", allow="GET, HEAD")
        if request.path == "/metrics":
            return Response(HTTPStatus.OK, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        if request.path in ("/healthz", "/readyz"):
            ok, detail = (self._healthy if request.path == "/healthz" else self._ready)()
            status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
            return Response(status, detail.encode(), "text/plain; charset=utf-8")
        if request.path == "/status" and self._status is not None:
            body = json.dumps(self._status(), indent=2).encode() + b"\n"
            return Response(HTTPStatus.OK, body, "application/json")
        return Response(HTTPStatus.NOT_FOUND, b"not found\n")


def _starting() -> tuple[bool, str]:
    return False, "not ready: starting\n"


def serve_http(port: int, healthy: Healthy, host: str = "") -> HttpServer:
    """Starts serving with the default bounds in background threads; `shutdown()` stops
    it (`HttpServer(...).start()` for other bounds)."""
    return HttpServer(port, healthy, host).start()
