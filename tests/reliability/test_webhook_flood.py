"""The admission webhook answers the API server in time while a pod floods it.

The webhook's port is reachable from every pod that may open a connection to it, and
it answers whoever POSTs an AdmissionReview. With `failurePolicy: Fail`, a review the
API server does not get an answer to within `webhook.timeoutSeconds` (10 s by default)
rejects the claim, so a webhook that one pod can stall rejects every claim with an
opaque config for this driver, cluster-wide.

The flood here, against the real server on loopback: idle TCP connections that never
start TLS, requests that announce a 3 MiB body and stall after a few bytes of it,
reviews whose `opaque.parameters` is a string holding a YAML alias bomb (a few hundred
bytes that expand to millions of paths), and complete reviews of a few MiB, from eight
loopback addresses (the webhook holds each address to 32 connections). Then
legitimate reviews, from an address of their own as the API server's, must be
answered, each within the API server's deadline (its protocol, not a guess of this
machine's speed), and the server must hold no thread per connection. The order of
answers against the large reviews is not asserted: while a worker parses one (a C call
that holds the GIL), the I/O thread waits, so a legitimate review's handshake and a
large review's parse take turns, and which finishes first depends on the machine (on
an idle one, five 2.8 MiB parses beat one handshake; CI saw both orders). Bounded: the
server is a process of its own, killed at the end (whatever the flood left it
computing ends with it), and every client socket has a timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from driver.config import API_VERSION, KIND
from driver.webhook.server import REQUEST_TIMEOUT, VALIDATE_PATH
from tests.unit.test_webhook import make_cert

DRIVER = "gpu.example.com"
LEGIT_REVIEWS = 3  # sent one after another while the bombs still arrive
IDLE = 150  # TCP connections that never send a byte
STALLED = 40  # TLS connections that announce a 3 MiB body and stop sending
BOMBS = 120  # complete reviews with an alias-bomb string as parameters
LARGE = 8  # complete reviews of about 2.8 MiB, each about a second to parse
BOMB_DEPTH = 20  # 2**20 paths: seconds of CPU each where the walk expands them
MAX_SERVER_THREADS = 8  # the main thread, the I/O thread, the workers
SENDER_TIMEOUT = 10.0  # seconds, for each step of a flood request
FLOOD_SOURCES = [f"127.0.1.{i}" for i in range(1, 9)]  # the flooding pods' addresses
API_SERVER = "127.0.0.2"


def flood_source(i: int) -> str:
    return FLOOD_SOURCES[i % len(FLOOD_SOURCES)]


@dataclass
class Served:
    process: subprocess.Popen[str]
    port: int
    context: ssl.SSLContext

    def tls(self, timeout: float, source: str) -> ssl.SSLSocket:
        address = ("127.0.0.1", self.port)
        raw = socket.create_connection(address, timeout=timeout, source_address=(source, 0))
        return self.context.wrap_socket(raw, server_hostname="localhost")

    def threads(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """The real gpu-dra-webhook process: whatever the flood leaves it doing ends with it."""
    cert, key = make_cert(tmp_path)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "driver.webhook.main",
            "--tls-cert-file",
            cert,
            "--tls-private-key-file",
            key,
            "--port",
            "0",
            "--bind-address",
            "127.0.0.1",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = _serving_port(process)
        yield Served(process, port, ssl.create_default_context(cafile=cert))
    finally:
        process.kill()
        process.wait(10)
        assert process.stderr is not None
        process.stderr.close()


def _serving_port(process: subprocess.Popen[str]) -> int:
    assert process.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        found = re.search(r"serving https on port (\d+)", line)
        if found:
            threading.Thread(target=process.stderr.read, daemon=True).start()  # keep it drained
            return int(found.group(1))
    pytest.fail("gpu-dra-webhook did not start")


def review(configs: list[dict[str, Any]], uid: str) -> bytes:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
                "config": configs,
            }
        },
    }
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "operation": "CREATE",
            "object": claim,
        },
    }
    return json.dumps(body).encode()


def opaque(parameters: Any, driver: str = DRIVER) -> dict[str, Any]:
    return {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}


def alias_bomb(depth: int) -> str:
    """A YAML mapping whose last list reaches 2**depth leaves through aliases."""
    lines = [f"apiVersion: {API_VERSION}", f"kind: {KIND}", "l0: &l0 [x, x]"]
    lines += [f"l{i}: &l{i} [*l{i - 1}, *l{i - 1}]" for i in range(1, depth)]
    return "\n".join(lines) + "\n"


def post_head(length: int) -> bytes:
    return (
        f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def answer_legit_review(served: Served) -> None:
    """A valid review over a fresh connection (as the API server opens them) is
    admitted; fails if any step takes longer than the API server waits for the
    webhook (its default timeoutSeconds, the server's REQUEST_TIMEOUT)."""
    conn = http.client.HTTPSConnection(
        "127.0.0.1",
        served.port,
        context=served.context,
        timeout=REQUEST_TIMEOUT,
        source_address=(API_SERVER, 0),
    )
    try:
        good = {"apiVersion": API_VERSION, "kind": KIND, "sharing": {"strategy": "TimeSlicing"}}
        conn.request(
            "POST",
            VALIDATE_PATH,
            body=review([opaque(good)], "legit"),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        answer = json.loads(response.read())
    except (TimeoutError, OSError, http.client.HTTPException) as err:
        pytest.fail(f"the legitimate review got no answer within {REQUEST_TIMEOUT} s: {err!r}")
    finally:
        conn.close()
    assert response.status == 200
    assert answer["response"] == {"uid": "legit", "allowed": True}


def read_answer(sock: ssl.SSLSocket) -> dict[str, Any]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 "), head
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))[15:]
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    answer: dict[str, Any] = json.loads(body)
    return answer


@dataclass
class Flood:
    """The flood's connections, held open until the end, and what each bomb got back."""

    sockets: list[socket.socket] = field(default_factory=list)
    answers: dict[str, object] = field(default_factory=dict)
    sent: set[str] = field(default_factory=set)  # whose whole request went out
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, sock: socket.socket) -> socket.socket:
        with self.lock:
            self.sockets.append(sock)
        return sock

    def send(self, served: Served, body: bytes, uid: str, source: str) -> None:
        """One complete request; its answer (or why there is none) goes to `answers`."""
        try:
            sock = self.hold(served.tls(SENDER_TIMEOUT, source))
            sock.sendall(post_head(len(body)) + body)
            with self.lock:
                self.sent.add(uid)
            self.answers[uid] = read_answer(sock)["response"]
        except (OSError, AssertionError, ValueError) as err:
            self.answers[uid] = repr(err)

    def close(self) -> None:
        with self.lock:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a sender blocked reading
                sock.close()


@pytest.mark.timeout(120)
def test_legitimate_reviews_are_answered_while_a_flood_is_served(served: Served) -> None:
    flood = Flood()
    senders = concurrent.futures.ThreadPoolExecutor(max_workers=16)
    try:
        for i in range(IDLE):  # connecting in the background: not held up by a backlog
            idle = flood.hold(socket.socket())
            idle.bind((flood_source(i), 0))
            idle.setblocking(False)
            idle.connect_ex(("127.0.0.1", served.port))
        for i in range(STALLED):
            stalled = flood.hold(served.tls(10, flood_source(i)))
            stalled.sendall(post_head(3 * 1024 * 1024) + b'{"apiVersion": ')
        # another driver's configs: many small objects, parsed whole, then skipped
        other = [opaque({"a": [{"b": i} for i in range(30)]}, "other.example.com")]
        large = review(other * 7000, "large")
        larges = {f"large-{i}" for i in range(LARGE)}
        sent = [
            senders.submit(flood.send, served, large, f"large-{i}", flood_source(i))
            for i in range(LARGE)
        ]
        bombs = [f"bomb-{i}" for i in range(BOMBS)]
        for i, uid in enumerate(bombs):
            body = review([opaque(alias_bomb(BOMB_DEPTH))], uid)
            sent.append(senders.submit(flood.send, served, body, uid, flood_source(i)))
        deadline = time.monotonic() + 30
        while not larges <= flood.sent | flood.answers.keys() and time.monotonic() < deadline:
            time.sleep(0.01)  # the legitimate reviews go in while the bombs still arrive

        for _ in range(LEGIT_REVIEWS):
            answer_legit_review(served)
        # no thread per connection: a couple of hundred open connections cost none
        assert served.threads() <= MAX_SERVER_THREADS

        concurrent.futures.wait(sent, timeout=30)
        refused = {
            "allowed": False,
            "status": {
                "status": "Failure",
                "code": 422,
                "reason": "Invalid",
                "message": "1 config failed to validate: spec.devices.config[0].opaque"
                ".parameters: must be a JSON object, got a string",
            },
        }
        # each bomb is refused at once, without being expanded (or, where the small
        # reviews' queue was full, answered 503 before it was parsed)
        answers = {uid: flood.answers.get(uid) for uid in bombs}
        denied = [uid for uid, got in answers.items() if got == {"uid": uid, **refused}]
        busy = [uid for uid, got in answers.items() if "HTTP/1.1 503 " in str(got)]
        assert len(denied) + len(busy) == BOMBS, answers
        assert len(denied) >= BOMBS // 2, answers
    finally:
        flood.close()
        senders.shutdown(wait=False, cancel_futures=True)  # they end with the server
