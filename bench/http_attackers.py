"""The floods of issue 34 (items 2 and 3) as client processes of their own, for
`bench.http_floods`: `python -m bench.http_attackers NAME PORT SECONDS`.

- `unread-answers` (webhook): 64 connections each POST a review whose `request.uid` is
  1.5 M characters of `é` (a 3 MB body; its answer is 9 MB after JSON escaping), four
  uploading at a time, and never read the answer; a closed one is opened again.
- `busy-reviews` (webhook): 64 keep-alive connections POST 62 KiB reviews back to back,
  each reading its answer before sending the next.
- `status-metrics` (plugin's HTTP port): 128 clients GET `/status` or `/metrics` in a
  loop, a connection each (the server closes after each answer).
- the slow and malformed clients of security rounds three and five and of issue 42
  (`idle-flood`, `slowloris`, `stalled-uploads`, `bare-lf-head`, `one-byte-heads`,
  `dribbled-bodies`, `near-limit-heads`, `per-address-cap`): `bench.http_hostile`.

Every client uses 127.0.0.1 (`per-address-cap`'s use 127.0.0.2); the legitimate client
measures from 127.0.0.2.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable

VALIDATE_PATH = "/validate-resource-claim-parameters"
ATTACKER = "127.0.0.1"


def review_body(uid: str, padding: int = 0) -> bytes:
    """An AdmissionReview of a ResourceClaim without configs; `padding` bytes of
    annotation make it larger."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns", "annotations": {"pad": "x" * padding}},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
    }
    request = {
        "uid": uid,
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
        "operation": "CREATE",
        "object": claim,
    }
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return json.dumps(body, ensure_ascii=False).encode()


def post(body: bytes) -> bytes:
    head = (
        f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_answer(sock: socket.socket) -> bool:
    """Reads one answer; False if the connection closed first."""
    return answer_status(sock) is not None


def answer_status(sock: socket.socket) -> int | None:
    """Reads one answer and returns its status code; None if the connection closed
    first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        (
            int(line[15:])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,  # every server measured declares its answers' length
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        body += chunk
    status = head.split(b" ", 2)[1:2]  # HTTP/1.1 200 OK
    return int(status[0]) if status and status[0].isdigit() else 0


def _client_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


CLIENT_CONTEXT = _client_context()


def connect(port: int, tls: bool, source: str = ATTACKER, timeout: float = 15) -> socket.socket:
    address = ("127.0.0.1", port)
    raw = socket.create_connection(address, timeout=timeout, source_address=(source, 0))
    try:
        return CLIENT_CONTEXT.wrap_socket(raw, server_hostname="localhost") if tls else raw
    except BaseException:
        raw.close()
        raise


UPLOADS = threading.Semaphore(4)  # 64 at once would each be evicted half-sent


def unread_answers(port: int, until: float) -> None:
    request = post(review_body("é" * 1_500_000))
    while time.monotonic() < until:
        with contextlib.suppress(OSError):
            with UPLOADS:
                sock = connect(port, tls=True)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.sendall(request)
            sock.settimeout(max(0.1, until - time.monotonic()))
            with contextlib.suppress(OSError):
                while sock.recv(1) and time.monotonic() < until:  # a byte a second: its close
                    time.sleep(1)
            sock.close()


def busy_reviews(port: int, until: float) -> None:
    request = post(review_body("busy", padding=62 << 10))
    while time.monotonic() < until:
        with contextlib.suppress(OSError):
            sock = connect(port, tls=True)
            while time.monotonic() < until:
                sock.sendall(request)
                if not read_answer(sock):
                    break
            sock.close()


def status_metrics(port: int, until: float, path: str) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    while time.monotonic() < until:
        with contextlib.suppress(OSError):
            sock = connect(port, tls=False)
            sock.sendall(request)
            read_answer(sock)
            sock.close()


def clients(name: str) -> list[Callable[[int, float], None]]:
    if name == "unread-answers":
        return [unread_answers] * 64
    if name == "busy-reviews":
        return [busy_reviews] * 64
    if name == "status-metrics":
        return [
            lambda port, until, i=i: status_metrics(port, until, ("/status", "/metrics")[i % 2])
            for i in range(128)
        ]
    from bench.http_hostile import HOSTILE  # it uses this module's clients

    if name in HOSTILE:
        return HOSTILE[name]()
    raise SystemExit(f"unknown flood {name!r}")


def main() -> None:
    name, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=c, args=(port, until), daemon=True) for c in clients(name)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()) + 15)


if __name__ == "__main__":
    main()
