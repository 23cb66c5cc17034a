"""HTTPS server for the admission webhook.

- `POST /validate-resource-claim-parameters`: AdmissionReview in, AdmissionReview out.
- `GET /readyz` (also `/healthz`, `/livez`): `200 ok`.

TLS only: every accepted connection is TLS from its first byte, so a plain-HTTP client
gets its connection closed. The certificate and key files are re-read when they change
on disk (cert-manager rotates them in place).

Any pod that can open a connection to the webhook can POST to it, and with
`failurePolicy: Fail` a review the API server gets no answer to in time rejects the
claim; so the server is bounded (`LIMITS`, on `driver.observability.bounded_http`):
docs/security.md, "How much a caller can take", gives each bound and what it stops.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
from http import HTTPStatus
from typing import Final

from driver.config import LoadError, loads_json
from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response
from driver.observability.listeners import listen_tcp
from driver.webhook.admission import BadReview, review

log = logging.getLogger(__name__)

VALIDATE_PATH: Final = "/validate-resource-claim-parameters"
HEALTH_PATHS: Final = frozenset({"/readyz", "/healthz", "/livez"})
# An AdmissionReview carries the object and, on UPDATE, the old one: each at most the
# API server's 1.5 MiB object limit.
MAX_BODY_BYTES: Final = 3 * 1024 * 1024
MAX_BUFFERED_BYTES: Final = 32 * 1024 * 1024
MAX_CONNECTIONS: Final = 64
WORKERS: Final = 2
# Far longer than a real request needs, and no longer than the API server waits
# (webhook timeoutSeconds, 10 s by default).
REQUEST_TIMEOUT: Final = 10.0
LIMITS: Final = Limits(
    timeout=REQUEST_TIMEOUT,
    max_connections=MAX_CONNECTIONS,
    workers=WORKERS,
    max_body=MAX_BODY_BYTES,
    max_buffered=MAX_BUFFERED_BYTES,
    keep_alive=True,
)


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


class WebhookServer(BoundedHttpServer):
    """Serves the webhook within `LIMITS` (other bounds: `limits`)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        cert_file: str,
        key_file: str,
        driver_name: str,
        limits: Limits = LIMITS,
    ) -> None:
        self.tls = TLSFiles(cert_file, key_file)
        self.driver_name = driver_name
        probes = dict.fromkeys(HEALTH_PATHS, lambda: Response(HTTPStatus.OK, b"ok"))
        super().__init__(
            listen_tcp(host, port),
            self._respond,
            limits,
            tls=self.tls.context,
            name="webhook",
            probes=probes,
        )

    def _respond(self, request: Request) -> Response:
        if request.method in ("GET", "HEAD"):
            return Response(HTTPStatus.NOT_FOUND, b"not found")
        if request.method != "POST":
            return Response(
                HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed", allow="GET, HEAD, POST"
            )
        if request.path != VALIDATE_PATH:
            return Response(HTTPStatus.NOT_FOUND, b"not found")
        content_type = request.headers.get("content-type", "")
        if content_type.split(";", 1)[0].strip().lower() != "application/json":
            return Response(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"contentType={content_type}, expected application/json".encode(),
            )
        try:
            answer = review(loads_json(request.body), self.driver_name)
        except (LoadError, BadReview) as err:
            message = f"failed to read AdmissionReview from request body: {err}"
            return Response(HTTPStatus.BAD_REQUEST, message.encode())
        response = answer["response"]
        if not response["allowed"]:
            log.info("denied %s: %s", response["uid"], response["status"]["message"])
        return Response(HTTPStatus.OK, json.dumps(answer).encode(), "application/json")
