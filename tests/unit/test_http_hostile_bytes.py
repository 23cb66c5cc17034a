"""Hostile bytes against the bounded HTTP server (issues 34 and 42): heads the parser
refuses cost that connection only; a handler that raises costs its request only;
answers a client never takes hold its connection only until the deadline; pipelined
requests are each answered."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

import pytest

from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response
from driver.observability.listeners import listen_tcp

pytestmark = pytest.mark.timeout(60)


def _head(content_length: bytes) -> bytes:
    return b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + content_length + b"\r\n\r\n"


@pytest.fixture
def serve() -> Iterator[Callable[..., BoundedHttpServer]]:
    servers: list[BoundedHttpServer] = []

    def _serve(handler: Callable[[Request], Response], **limits: Any) -> BoundedHttpServer:
        probes = limits.pop("probes", None)
        server = BoundedHttpServer(
            listen_tcp("127.0.0.1", 0), handler, Limits(**limits), probes=probes
        )
        server.start()
        servers.append(server)
        return server

    yield _serve
    for server in servers:
        server.shutdown()


def _echo(request: Request) -> Response:
    return Response(HTTPStatus.OK, request.body)


def _connect(server: BoundedHttpServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


@pytest.mark.parametrize(
    "declared",
    [b"\xb2", b"\xb3", b"\xb9", b"1\xb2", b"+5", b"-1", b" ", b"1_0", b"0x5", b"5 5", b"9" * 16],
)
def test_content_length_other_than_ascii_digits_is_refused(
    serve: Callable[..., BoundedHttpServer], declared: bytes
) -> None:
    server = serve(_echo, max_body=1 << 20, timeout=30)
    with _connect(server) as sock:
        sock.sendall(_head(declared))
        assert _answer(sock).split(b" ", 2)[1] in (b"400", b"413")


@pytest.mark.parametrize(
    "head",
    [
        # no header smuggled by a latin-1 NEL or a file separator in another one's value
        b"POST / HTTP/1.1\r\nHost: x\r\nX-A: a\x85Content-Length: 5\x1cz\r\n\r\nhello",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nab",
    ],
)
def test_ambiguous_bodies_are_refused(serve: Callable[..., BoundedHttpServer], head: bytes) -> None:
    """Whatever the body's length might be taken for, it is never echoed as a request."""
    server = serve(_echo, max_body=1 << 20, timeout=30)
    with _connect(server) as sock:
        sock.sendall(head)
        assert not _answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_plain_content_length_is_still_read(serve: Callable[..., BoundedHttpServer]) -> None:
    server = serve(_echo, max_body=16, timeout=30)
    with _connect(server) as sock:
        sock.sendall(_head(b"0012") + b"twelve bytes")
        assert _answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_superscript_content_length_is_answered_400_and_others_still_served(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """Before: int('²') raised ValueError in the I/O thread at every byte."""
    server = serve(_echo, max_body=16, timeout=30)
    attacker = _connect(server)
    attacker.sendall(_head(b"\xb2"))
    assert _answer(attacker).split(b" ", 2)[1] == b"400"
    for _ in range(3):
        other = _connect(server)
        other.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok")
        assert _answer(other).startswith(b"HTTP/1.1 200 ")
        other.close()
    attacker.close()


def test_a_handler_that_raises_costs_that_request_only(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """A 500 for the request whose handler raised, counted; the next one is served by
    the same worker."""

    def handler(request: Request) -> Response:
        if request.target == "/bad":
            raise RuntimeError("a bug")
        return Response(HTTPStatus.OK, b"fine")

    server = serve(handler, timeout=30, workers=1)
    bad, good = _connect(server), _connect(server)
    bad.sendall(b"GET /bad HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _answer(bad).startswith(b"HTTP/1.1 500 ")
    good.sendall(b"GET /good HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _answer(good).startswith(b"HTTP/1.1 200 ")
    assert server.stats.failed == 1
    bad.close()
    good.close()


def _never_reading(server: BoundedHttpServer, target: bytes) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


def _large_answers(request: Request) -> Response:
    size = 16 << 20 if request.target == "/large" else 2
    return Response(HTTPStatus.OK, b"x" * size)


def test_clients_that_do_not_take_their_answers_are_closed_at_the_deadline(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """Four answers of 16 MiB nobody reads: another client is served meanwhile, and
    the four are closed once their answers' `timeout` has passed."""
    server = serve(_large_answers, timeout=1, workers=1)
    readers = [_never_reading(server, b"/large") for _ in range(4)]
    probe = _connect(server)
    probe.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")  # one worker: answered after the four
    assert _answer(probe).startswith(b"HTTP/1.1 200 ")
    for _ in range(3000):  # the deadline passes, counted in rounds of polling
        if server.stats.timed_out >= 4:
            break
        time.sleep(0.01)
    assert server.stats.timed_out >= 4
    for sock in readers:  # closed part way through its answer
        taken = 0
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 20):
                taken += len(chunk)
        assert taken < 16 << 20
    for sock in [*readers, probe]:
        sock.close()


def test_a_full_table_evicts_a_client_that_does_not_read(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """Every slot holds an answer its client does not take: a new client evicts the
    oldest of them instead of being refused."""
    server = serve(_large_answers, timeout=30, max_connections=4, max_buffered=1 << 30)
    readers = [_never_reading(server, b"/large") for _ in range(4)]
    for sock in readers:  # each has its answer started: the first bytes arrived
        assert sock.recv(1) == b"H"
    probe = _connect(server)
    probe.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _answer(probe).startswith(b"HTTP/1.1 200 ")
    assert server.stats.refused == 0 and server.stats.evicted >= 1
    for sock in [*readers, probe]:
        sock.close()


def test_pipelined_requests_are_each_answered(serve: Callable[..., BoundedHttpServer]) -> None:
    """Two requests in one send on a kept-alive connection. Before: the second was
    answered only once more bytes came, or never (closed at the deadline)."""
    server = serve(_echo, timeout=30, keep_alive=True, max_body=16)
    sock = _connect(server)
    one = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
    sock.sendall(one + b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo")
    answers = b""
    while answers.count(b"HTTP/1.1 200 ") < 2 or not answers.endswith(b"two"):
        chunk = sock.recv(4096)
        assert chunk, f"closed after {answers!r}"
        answers += chunk
    assert answers.index(b"one") < answers.index(b"two")
    sock.close()


def test_many_pipelined_probes_are_answered_in_turns(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """500 probes in one send, each answered by the I/O thread itself: all answered, in
    turns (no recursion per request), and another client is served meanwhile."""
    ok = Response(HTTPStatus.OK, b"ok")
    server = serve(_echo, timeout=30, keep_alive=True, probes={"/healthz": lambda: ok})
    sock = _connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 500)
    other = _connect(server)
    other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert _answer(other).startswith(b"HTTP/1.1 200 ")
    answers = b""
    while answers.count(b"HTTP/1.1 200 ") < 500:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {answers.count(b'HTTP/1.1 200 ')} answers"
        answers += chunk
    assert server.stats.failed == 0
    sock.close()
    other.close()
