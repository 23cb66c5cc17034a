"""What one pod cannot do to the webhook, round four (issue 34): a head the parser
chokes on, answers it never reads, slots it keeps busy. The legitimate reviews come
from another loopback address (127.0.0.2), as the API server's come from another peer;
each test counts answers and orders events, never a wall-clock deadline."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_webhook import Served, admission, claim, config, make_cert

from driver.config import API_VERSION, KIND
from driver.webhook.admission import BadReview, review
from driver.webhook.server import VALIDATE_PATH, WebhookServer

pytestmark = pytest.mark.timeout(60)

DRIVER = "gpu.example.com"
GOOD = {"apiVersion": API_VERSION, "kind": KIND, "sharing": {"strategy": "TimeSlicing"}}
API_SERVER = "127.0.0.2"  # the legitimate client's address; attackers use 127.0.0.1


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    cert, key = make_cert(tmp_path)
    server = WebhookServer("127.0.0.1", 0, cert_file=cert, key_file=key, driver_name=DRIVER)
    server.start()
    try:
        yield Served(server, cert)
    finally:
        server.shutdown()


def tls(served: Served, source: str = "127.0.0.1", timeout: float = 10) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=served.cafile)
    raw = socket.create_connection(
        ("127.0.0.1", served.server.port), timeout=timeout, source_address=(source, 0)
    )
    return context.wrap_socket(raw, server_hostname="localhost")


def request(body: bytes, *, content_length: bytes | None = None, keep_alive: bool = True) -> bytes:
    length = str(len(body)).encode() if content_length is None else content_length
    return (
        b"POST " + VALIDATE_PATH.encode() + b" HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: "
        + length
        + b"\r\n"
        + (b"" if keep_alive else b"Connection: close\r\n")
        + b"\r\n"
        + body
    )


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one answer; (0, b"") if the connection closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = next(int(h[15:]) for h in lines if h.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, b""
        body += chunk
    return int(lines[0].split()[1]), body


def legit_review(served: Served, uid: str = "legit") -> dict[str, Any]:
    """The API server's review over a fresh connection from its own address."""
    sock = tls(served, API_SERVER)
    try:
        sock.sendall(
            request(
                json.dumps(admission(claim([config(GOOD)]), "resourceclaims", uid=uid)).encode()
            )
        )
        status, body = read_answer(sock)
    finally:
        sock.close()
    assert status == 200, body
    answer: dict[str, Any] = json.loads(body)["response"]
    return answer


def test_a_superscript_content_length_dribbler_does_not_silence_the_webhook(
    served: Served,
) -> None:
    """Before: every byte after a `Content-Length: ²` head raised in the I/O thread,
    which then slept; no review was answered while the dribbler lived."""
    attacker = tls(served)
    attacker.sendall(request(b"", content_length=b"\xb2"))
    stop = threading.Event()

    def dribble() -> None:
        with contextlib.suppress(OSError):
            while not stop.wait(0.05):
                attacker.send(b"{")

    dribbler = threading.Thread(target=dribble, daemon=True)
    dribbler.start()
    try:
        answers = [legit_review(served, f"legit-{i}") for i in range(3)]
        assert answers == [{"uid": f"legit-{i}", "allowed": True} for i in range(3)]
        assert read_answer(attacker)[0] == 400
    finally:
        stop.set()
        dribbler.join()
        attacker.close()


@pytest.mark.parametrize(
    "uid",
    ["é" * 1_500_000, "a" * 129, "uid\nINFO forged line", "", "a b", "\u202e-reversed"],
)
def test_a_uid_that_is_not_a_uid_is_refused(uid: str) -> None:
    """Before: echoed at any length (1.5 M `é` became a 9 MiB answer)."""
    with pytest.raises(BadReview, match="uid"):
        review(admission(claim([config(GOOD)]), "resourceclaims", uid=uid), DRIVER)


@pytest.mark.parametrize("uid", ["705ab4f5-6393-11e8-b7cc-42010a800002", "uid-1", "legit"])
def test_uids_as_the_api_server_sends_them_are_echoed(uid: str) -> None:
    answer = review(admission(claim([config(GOOD)]), "resourceclaims", uid=uid), DRIVER)
    assert answer["response"] == {"uid": uid, "allowed": True}
