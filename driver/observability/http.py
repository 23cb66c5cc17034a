"""The plugin's HTTP endpoint: /metrics for Prometheus, /healthz for the liveness probe."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from driver.observability.metrics import REGISTRY


def serve_http(
    port: int, healthy: Callable[[], tuple[bool, str]], host: str = ""
) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._reply(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                ok, detail = healthy()
                self._reply(200 if ok else 503, detail.encode(), "text/plain")
            else:
                self._reply(404, b"not found\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds would drown the log

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
