"""What one pod's slow or malformed requests cannot do to the webhook, round five (issue
42): a head ended by a bare LF, a head in one-byte TLS records, a body dribbled after a
full head, heads one byte short of the head limit. The API server's reviews (from
127.0.0.2) are answered while each attack runs and after it stops; each test counts
answers, never a wall-clock deadline (the client's 10 s socket timeout is the API
server's own `timeoutSeconds`)."""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import gc
import socket
import ssl
import threading
from collections.abc import Callable, Iterator

import pytest
from test_webhook import Served
from test_webhook_hostile_clients import legit_review, served, tls

from driver.webhook.server import VALIDATE_PATH

pytestmark = pytest.mark.timeout(120)

__all__ = ["served"]  # the fixture, imported for the tests below

HEAD_LIMIT = 8192
HEAD = (
    f"POST {VALIDATE_PATH} HTTP/1.1\nHost: localhost\nContent-Type: application/json\n"
    "Content-Length: 3145728\n\n"
).encode()

Attack = Callable[[Served, threading.Event, threading.Event], None]


def bare_lf_head_then_one_byte_records(
    served: Served, stop: threading.Event, ready: threading.Event
) -> None:
    """H1: a head ended by `\\n\\n`, 3 MB of `\\r` (less than its Content-Length), then
    one-byte TLS records: each read made the old server rescan its whole buffer for
    `\\r\\n\\r\\n` on its only I/O thread."""
    while not stop.is_set():
        with contextlib.suppress(OSError), tls(served) as sock:
            sock.sendall(HEAD + b"\r" * 3_000_000)
            ready.set()
            while not stop.is_set():
                sock.send(b"\r")


def head_in_one_byte_records(served: Served, stop: threading.Event, ready: threading.Event) -> None:
    head = HEAD.replace(b"\n", b"\r\n")
    while not stop.is_set():
        with contextlib.suppress(OSError), tls(served) as sock:
            for byte in head * 4:  # never a whole head: the second request line is a header
                ready.set()
                if stop.wait(0.001):
                    return
                sock.send(bytes([byte]))


def body_dribbled_after_a_full_head(
    served: Served, stop: threading.Event, ready: threading.Event
) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError), tls(served) as sock:
            sock.sendall(HEAD.replace(b"\n", b"\r\n"))
            ready.set()
            while not stop.wait(0.001):
                sock.send(b" ")


def heads_one_byte_short_of_the_limit(
    served: Served, stop: threading.Event, ready: threading.Event
) -> None:
    start = f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: localhost\r\nX-Pad: ".encode()
    head = start + b"a" * (HEAD_LIMIT - 1 - len(start))
    while not stop.is_set():
        with contextlib.suppress(OSError), tls(served) as sock:
            sock.sendall(head)
            ready.set()
            while not stop.wait(0.01):
                sock.sendall(head)  # the same bytes again, as a header's continuation


@contextlib.contextmanager
def attacking(served: Served, attack: Attack, clients: int) -> Iterator[None]:
    stop, ready = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=attack, args=(served, stop, ready), daemon=True)
        for _ in range(clients)
    ]
    for thread in threads:
        thread.start()
    try:
        assert ready.wait(60), "the attack did not start"
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)


@pytest.mark.parametrize(
    ("attack", "clients"),
    [
        (bare_lf_head_then_one_byte_records, 1),
        (head_in_one_byte_records, 8),
        (body_dribbled_after_a_full_head, 8),
        (heads_one_byte_short_of_the_limit, 8),
    ],
)
def test_reviews_are_answered_during_and_after_a_slow_request_attack(
    served: Served, attack: Attack, clients: int
) -> None:
    with attacking(served, attack, clients):
        during = [legit_review(served, f"during-{i}") for i in range(3)]
    after = [legit_review(served, f"after-{i}") for i in range(3)]
    assert during == [{"uid": f"during-{i}", "allowed": True} for i in range(3)]
    assert after == [{"uid": f"after-{i}", "allowed": True} for i in range(3)]


def test_a_head_without_carriage_returns_is_refused_at_once(served: Served) -> None:
    """A head whose lines end in a bare LF is refused (RFC 9112 2.2 lets a server
    refuse it) as soon as its first line is read, and the connection closes: it is
    never taken for an unfinished head that later bytes might complete."""
    with tls(served) as sock:
        sock.sendall(b"GET /readyz HTTP/1.1\nHost: localhost\nConnection: close\n\n")
        answer = b""
        with contextlib.suppress(OSError, ssl.SSLError):
            while chunk := sock.recv(4096):
                answer += chunk
    assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), answer[:80]


def test_an_over_long_head_closes_only_its_connection(served: Served) -> None:
    with tls(served) as sock:
        sock.sendall(b"GET /readyz HTTP/1.1\r\nX-Pad: " + b"a" * (4 * HEAD_LIMIT) + b"\r\n\r\n")
        answer = b""
        with contextlib.suppress(OSError, ssl.SSLError):
            while chunk := sock.recv(4096):
                answer += chunk
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:80]
    assert legit_review(served) == {"uid": "legit", "allowed": True}


def test_the_api_servers_address_at_the_per_address_cap_is_still_answered(
    served: Served,
) -> None:
    """L3: where pods share the API server's source address (a sidecar proxy, SNAT), a
    flood of idle connections from that address makes room for the API server's review
    instead of refusing it."""
    idle = []
    try:
        for _ in range(40):
            raw = socket.create_connection(
                ("127.0.0.1", served.server.port), timeout=10, source_address=("127.0.0.2", 0)
            )
            idle.append(raw)
        answers = [legit_review(served, f"shared-{i}") for i in range(3)]
    finally:
        for raw in idle:
            raw.close()
    assert answers == [{"uid": f"shared-{i}", "allowed": True} for i in range(3)]


def test_connections_closed_before_their_handshake_leave_nothing_behind(
    served: Served,
) -> None:
    """A connection evicted before its TLS handshake began is freed at once. Before:
    each one's handshake waited for its timeout (10 s) holding a 256 KiB TLS buffer,
    and a slowloris flood churning through one address's cap took the webhook to
    1.3 GiB."""
    for _ in range(200):  # each beyond the address's cap closes the oldest
        with socket.create_connection(("127.0.0.1", served.server.port), timeout=10):
            pass
    legit_review(served)  # every connection above has been handled by now
    gc.collect()
    tls_connections = sum(isinstance(o, asyncio.sslproto.SSLProtocol) for o in gc.get_objects())
    assert tls_connections <= served.server.limits.max_per_peer + 1
