"""HTTPS server for the admission webhook (standard library only).

- `POST /validate-resource-claim-parameters`: AdmissionReview in, AdmissionReview out.
- `GET /readyz` (also `/healthz`, `/livez`): `200 ok`.

TLS only: every accepted connection is wrapped server-side before any byte is read,
so a plain-HTTP client gets its connection closed. The handshake runs in the
connection's own thread (a slow or idle client cannot stall the accept loop), with
a timeout. The certificate and key files are re-read when they change on disk
(cert-manager rotates them in place).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

from driver.config import LoadError, loads_json
from driver.webhook.admission import BadReview, review

log = logging.getLogger(__name__)

VALIDATE_PATH: Final = "/validate-resource-claim-parameters"
HEALTH_PATHS: Final = frozenset({"/readyz", "/healthz", "/livez"})
MAX_BODY_BYTES: Final = 3 * 1024 * 1024  # the API server's own request size limit
HANDSHAKE_TIMEOUT: Final = 10.0
REQUEST_TIMEOUT: Final = 30.0


class TLSFiles:
    """An SSLContext for a cert/key pair, rebuilt when either file changes."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self._lock = threading.Lock()
        self._stamp = self._current_stamp()
        self._context = self._load()  # errors here are fatal (startup)

    def _current_stamp(self) -> tuple[int, ...]:
        stamp: list[int] = []
        for name in (self.cert_file, self.key_file):
            st = os.stat(name)
            stamp += [st.st_mtime_ns, st.st_size, st.st_ino]
        return tuple(stamp)

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        context.set_alpn_protocols(["http/1.1"])
        return context

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._current_stamp()
                if stamp != self._stamp:
                    self._context = self._load()
                    self._stamp = stamp
                    log.info("reloaded TLS certificate %s", self.cert_file)
            except (OSError, ssl.SSLError) as err:
                # mid-rotation (one file written, not the other) or gone: keep the old one
                log.warning("cannot reload TLS certificate, keeping the previous one: %s", err)
            return self._context


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    server_version = "gpu-dra-webhook"
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def do_GET(self) -> None:
        if self._path() in HEALTH_PATHS:
            self._send(HTTPStatus.OK, b"ok")
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found")

    def do_POST(self) -> None:
        # Read the body first, even for requests that will be refused: closing a TLS
        # connection with unread input resets it and can destroy the response.
        length_header = self.headers.get("Content-Length")
        if length_header is None or not length_header.strip().isdigit():
            self.close_connection = True
            self._send(HTTPStatus.LENGTH_REQUIRED, b"Content-Length required")
            return
        length = int(length_header)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"request body too large")
            return
        body = self.rfile.read(length)
        if self._path() != VALIDATE_PATH:
            self._send(HTTPStatus.NOT_FOUND, b"not found")
            return
        content_type = self.headers.get("Content-Type", "")
        if content_type.split(";", 1)[0].strip().lower() != "application/json":
            self._send(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"contentType={content_type}, expected application/json".encode(),
            )
            return
        try:
            answer = review(loads_json(body), self.server.driver_name)
        except (LoadError, BadReview) as err:
            message = f"failed to read AdmissionReview from request body: {err}"
            self._send(HTTPStatus.BAD_REQUEST, message.encode())
            return
        response = answer["response"]
        if not response["allowed"]:
            log.info("denied %s: %s", response["uid"], response["status"]["message"])
        self._send(HTTPStatus.OK, json.dumps(answer).encode(), "application/json")


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, host: str, port: int, *, cert_file: str, key_file: str, driver_name: str
    ) -> None:
        self.tls = TLSFiles(cert_file, key_file)
        self.driver_name = driver_name
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        port: int = self.server_address[1]
        return port

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the connection's thread: TLS handshake, then HTTP."""
        request.settimeout(HANDSHAKE_TIMEOUT)
        try:
            tls_socket = self.tls.context().wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as err:
            log.debug("TLS handshake with %s failed: %s", client_address, err)
            return
        try:
            _Handler(tls_socket, client_address, self)
        finally:
            tls_socket.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("error serving %s", client_address, exc_info=True)
