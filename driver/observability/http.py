"""The plugin's HTTP endpoint: /metrics for Prometheus, /healthz for the liveness probe,
/readyz for the readiness probe (503 "starting" until `serve_readiness` named its
source: driver.plugin.readiness), and /readyz/reason: /readyz's text with status 200,
ready or not (the API server's pod proxy passes a 503 on as `ServiceUnavailable`,
without the text). /status is not here: it names the node's GPUs, their failures and
claims, and is served only on the root-only status socket
(`driver.observability.status_socket`).

The port is reachable from every pod that may talk to the plugin pod, so the server is
bounded against idle and slow clients (`driver.observability.bounded_http`, on
aiohttp): a deadline of `timeout` seconds (default 5) to deliver the request and again
to take the answer, at most `max_connections` (default 64) open (a new one closes the
oldest without a worker, so that a flood of idle connections cannot lock out the
probe; at most 32 from one address, where the oldest of its own makes room),
`workers` threads (default 2) computing /metrics (`generate_latest`), /readyz and
/readyz/reason (they dial the plugin's sockets, up to 2 s each), at most 16 of those
waiting (503 beyond; while some wait, /metrics is rendered at most once a second).
/healthz is answered on the event loop itself, so busy workers never hold the liveness
probe. One request per connection (`Connection: close`), GET and HEAD only; request
bodies are not read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response
from driver.observability.listeners import listen_tcp
from driver.observability.metrics import REGISTRY

DEFAULT_TIMEOUT: Final = 5.0
DEFAULT_MAX_CONNECTIONS: Final = 64
DEFAULT_WORKERS: Final = 2
# While other requests wait for a worker, /metrics (and the status socket's /status)
# answer with their last render if it is younger than this: clients requesting them in a
# loop cost at most a render a second each. An idle server renders every request afresh
# (a scrape, or the CLI's /status, always sees the current values).
RENDER_MAX_AGE: Final = 1.0
# /readyz's text with status 200 (for `kubectl get --raw .../pods/<pod>:<port>/proxy/...`).
READY_REASON_PATH: Final = "/readyz/reason"

Healthy = Callable[[], tuple[bool, str]]


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
        self._ready: Healthy = _starting
        limits = Limits(timeout=timeout, max_connections=max_connections, workers=workers)
        self._metrics = CachedRender(lambda: generate_latest(REGISTRY), RENDER_MAX_AGE)
        super().__init__(
            listen_tcp(host, port), self._respond, limits, probes={"/healthz": self._health}
        )

    @property
    def timeout(self) -> float:
        return self.limits.timeout

    @property
    def max_connections(self) -> int:
        return self.limits.max_connections

    def serve_readiness(self, ready: Healthy) -> None:
        """Answer /readyz from `ready()` from now on (503 "starting" before)."""
        self._ready = ready

    def start(self) -> HttpServer:
        super().start()
        return self

    def _respond(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", allow="GET, HEAD")
        busy = self.waiting_requests > 0  # then an answer up to a second old will do
        if request.path == "/metrics":
            return Response(HTTPStatus.OK, self._metrics(reuse=busy), CONTENT_TYPE_LATEST)
        if request.path == "/readyz":  # in a worker: `ready` dials the plugin's sockets
            return health_response(self._ready)
        if request.path == READY_REASON_PATH:
            return reason_response(self._ready)
        return Response(HTTPStatus.NOT_FOUND, b"not found\n")

    def _health(self) -> Response:  # on the event loop: `healthy` only reads flags
        return health_response(self._healthy)


def reason_response(healthy: Healthy) -> Response:
    """200 with `healthy()`'s detail, whatever it says."""
    _, detail = healthy()
    return Response(HTTPStatus.OK, detail.encode(), "text/plain; charset=utf-8")


def health_response(healthy: Healthy) -> Response:
    """200 or 503 with `healthy()`'s detail."""
    ok, detail = healthy()
    status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
    return Response(status, detail.encode(), "text/plain; charset=utf-8")


class CachedRender:
    """`render()`'s bytes, rendered afresh unless the caller says the last render will
    do (`reuse`) and it is younger than `max_age` seconds (by `clock`). One render at a
    time: callers of a stale one wait for it."""

    def __init__(
        self,
        render: Callable[[], bytes],
        max_age: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._render = render
        self._max_age = max_age
        self._clock = clock
        self._lock = threading.Lock()
        self._rendered: tuple[float, bytes] | None = None

    def __call__(self, *, reuse: bool) -> bytes:
        with self._lock:
            now = self._clock()
            last = self._rendered
            if not reuse or last is None or now - last[0] >= self._max_age:
                last = self._rendered = (now, self._render())
            return last[1]


def _starting() -> tuple[bool, str]:
    return False, "not ready: starting\n"
