"""The plugin's status socket: GET /status (the JSON document `gpu-dra status`,
`health` and `inventory` read) and /healthz, over HTTP on a Unix socket in the
plugin's data directory on the host (`status.sock`), mode 0600: only root on the node
(a node-problem-detector plugin, `kubectl debug node/...`, or `kubectl exec` into the
plugin pod, where the directory is mounted at the same path) can open it. No port in
the pod network answers /status.

Served by the same bounded server as the HTTP port (`driver.observability.bounded_http`),
with its limits: one I/O thread, a deadline per request, at most 16 open connections,
one worker rendering /status (at most once a second while requests wait).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http import RENDER_MAX_AGE, CachedRender, Healthy, health_response
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response
from driver.observability.listeners import UnixListener, listen_unix, remove_unix

SOCKET_NAME: Final = "status.sock"
# Root on one node is the only client: a few connections are plenty, and every one of
# them is within the limits (`max_per_peer`: a Unix socket's clients share no address).
LIMITS: Final = Limits(max_connections=16, max_per_peer=16, workers=1, max_queued=8)

Status = Callable[[], dict[str, Any]]


def status_socket_path(data_dir: Path) -> Path:
    return data_dir / SOCKET_NAME


class StatusSocketServer(BoundedHttpServer):
    """Serves /status and /healthz on the Unix socket `path` (see the module docstring);
    `shutdown()` removes the socket unless a newer instance has replaced it."""

    def __init__(
        self, path: Path, status: Status, healthy: Healthy, limits: Limits = LIMITS
    ) -> None:
        self._unix: UnixListener = listen_unix(path, 0o600)
        self._status = CachedRender(
            lambda: json.dumps(status(), indent=2).encode() + b"\n", RENDER_MAX_AGE
        )
        probes = {"/healthz": lambda: health_response(healthy)}
        super().__init__(self._unix.sock, self._respond, limits, name="status", probes=probes)

    @property
    def path(self) -> Path:
        return self._unix.path

    def start(self) -> StatusSocketServer:
        super().start()
        return self

    def shutdown(self) -> None:
        super().shutdown()
        remove_unix(self._unix)

    server_close = shutdown

    def _respond(self, request: Request) -> Response:
        if request.method not in ("GET", "HEAD"):
            return Response(HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", allow="GET, HEAD")
        if request.path == "/status":
            body = self._status(reuse=self.waiting_requests > 0)
            return Response(HTTPStatus.OK, body, "application/json")
        return Response(HTTPStatus.NOT_FOUND, b"not found\n")
