"""The plugin's status socket: HTTP on a Unix socket in the plugin's data directory on
the host (`status.sock`), mode 0600: only root on the node (a node-problem-detector
plugin, `kubectl debug node/...`, or `kubectl exec` into the plugin pod, where the
directory is mounted at the same path) can open it. No port in the pod network answers
any of these paths:

- `GET /status`: the JSON document `gpu-dra status`, `health` and `inventory` read.
- `GET /healthz`.
- `GET /control` and `POST /control/<action>`: the plugin's control requests
  (`gpu-dra health clear`, and on the mock backend `gpu-dra mock ...`), handed to
  `control` (`driver.health.control_queue.ControlQueue.respond`, whose docstring gives the
  requests and answers); 404 where the server has no `control`.

Served by the same bounded server as the HTTP port (`driver.observability.bounded_http`)
within `LIMITS`: two workers, as a control request holds one until the health monitor
applied it; /status is rendered at most once a second while requests wait.

During a rolling update the socket belongs to the plugin instance that serves the node
(`ServingStatusSocket`, driver.plugin.serving_instance): an instance binds it each time it
starts serving, replacing the other's, and one that never serves (a new pod the
kubelet never registers) never binds it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http import RENDER_MAX_AGE, CachedRender, Healthy, health_response
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response
from driver.observability.listeners import UnixListener, listen_unix, remove_unix, still_bound

log = logging.getLogger(__name__)

SOCKET_NAME: Final = "status.sock"
# Root on one node is the only client: a few connections are plenty, and every one of
# them is within the limits (`max_per_peer`: a Unix socket's clients share no address).
LIMITS: Final = Limits(
    max_connections=16, max_per_peer=16, workers=2, max_queued=8, max_body=64 << 10
)
CONTROL: Final = "/control"

Status = Callable[[], dict[str, Any]]
Control = Callable[[Request], Response]  # GET /control, POST /control/<action>


def status_socket_path(data_dir: Path) -> Path:
    return data_dir / SOCKET_NAME


class StatusSocketServer(BoundedHttpServer):
    """Serves /status, /healthz and /control on the Unix socket `path` (see the module
    docstring); `shutdown()` removes the socket unless a newer instance has replaced it."""

    def __init__(
        self,
        path: Path,
        status: Status,
        healthy: Healthy,
        limits: Limits = LIMITS,
        *,
        control: Control | None = None,
    ) -> None:
        self._control = control
        self._unix: UnixListener = listen_unix(path, 0o600)
        self._status = CachedRender(
            lambda: json.dumps(status(), indent=2).encode() + b"\n", RENDER_MAX_AGE
        )
        probes = {"/healthz": lambda: health_response(healthy)}
        super().__init__(self._unix.sock, self._respond, limits, name="status", probes=probes)

    @property
    def path(self) -> Path:
        return self._unix.path

    def still_bound(self) -> bool:
        """False once another instance's socket replaced this one's at `path`."""
        return still_bound(self._unix)

    def start(self) -> StatusSocketServer:
        super().start()
        return self

    def shutdown(self) -> None:
        super().shutdown()
        remove_unix(self._unix)

    server_close = shutdown

    def _respond(self, request: Request) -> Response:
        if request.path == CONTROL or request.path.startswith(CONTROL + "/"):
            if self._control is None:
                return Response(HTTPStatus.NOT_FOUND, b"not found\n")
            return self._control(request)
        if request.method not in ("GET", "HEAD"):
            return Response(HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", allow="GET, HEAD")
        if request.path == "/status":
            body = self._status(reuse=self.waiting_requests > 0)
            return Response(HTTPStatus.OK, body, "application/json")
        return Response(HTTPStatus.NOT_FOUND, b"not found\n")


class ServingStatusSocket:
    """The status socket of the instance that serves the node: `serving(True)` binds it
    (again, when another instance's socket replaced this one's meanwhile);
    `serving(False)` closes this one's once another replaced it."""

    def __init__(self, bind: Callable[[], StatusSocketServer]) -> None:
        self._bind = bind
        self._server: StatusSocketServer | None = None
        self._lock = threading.Lock()

    def serving(self, serving: bool) -> None:
        with self._lock:
            server = self._server
            if server is not None and server.still_bound():
                return
            if server is not None:
                server.shutdown()  # replaced by another instance's: unreachable
                self._server = None
            if serving:
                self._server = self._bind().start()
                log.info("serving /status on %s (root only)", self._server.path)

    def shutdown(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server = None
