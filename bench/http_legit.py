"""The legitimate clients of `bench.http_floods`, one request at a time on a fresh
connection: the API server's review (from 127.0.0.2), the kubelet's probes of the
webhook (from 127.0.0.3, the node's address) and of the plugin's port (127.0.0.2)."""

from __future__ import annotations

import socket

# One client context, made once as the API server keeps its own (loading the system's CA
# store for every review would time the client's CPU, not the webhook).
from bench.http_attackers import CLIENT_CONTEXT, answer_status, post, review_body

LEGIT = "127.0.0.2"
KUBELET = "127.0.0.3"
REVIEW_TIMEOUT = 10.0  # the API server's default webhook timeoutSeconds
PROBE_TIMEOUT = 5.0  # the plugin's liveness probe (chart)
WEBHOOK_PROBE_TIMEOUT = 1.0  # the webhook's probes (the kubelet's default; the chart sets none)


def _connect(port: int, timeout: float, source: str = LEGIT) -> socket.socket:
    address = ("127.0.0.1", port)
    return socket.create_connection(address, timeout=timeout, source_address=(source, 0))


def _tls_request(port: int, request: bytes, timeout: float, source: str = LEGIT) -> bool:
    try:
        with (
            _connect(port, timeout, source) as raw,
            CLIENT_CONTEXT.wrap_socket(raw, server_hostname="x") as sock,
        ):
            sock.sendall(request)
            return answer_status(sock) == 200
    except (OSError, ValueError):
        return False


def legit_review(port: int) -> bool:
    return _tls_request(port, post(review_body("legit")), REVIEW_TIMEOUT)


def webhook_probe(port: int) -> bool:
    request = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
    return _tls_request(port, request, WEBHOOK_PROBE_TIMEOUT, KUBELET)


def healthz_probe(port: int) -> bool:
    try:
        with _connect(port, PROBE_TIMEOUT) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(PROBE_TIMEOUT)
            return sock.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
