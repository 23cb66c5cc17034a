"""Round four against the bounded HTTP server (issue 34, items 1, 2 and 12): bytes
that are not what the parser expects, and exceptions while one connection is handled,
cost that connection only, the I/O thread serving everyone else; answers a client
never reads count against the memory budget and make it evictable; pipelined requests
are each answered."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

import pytest

from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response, body_length, parse_head
from driver.observability.listeners import listen_tcp

pytestmark = pytest.mark.timeout(60)


def _head(content_length: bytes) -> bytes:
    return b"POST / HTTP/1.1\r\nContent-Length: " + content_length + b"\r\n\r\n"


@pytest.mark.parametrize(
    "declared",
    [b"\xb2", b"\xb3", b"\xb9", b"1\xb2", b"+5", b"-1", b" ", b"1_0", b"0x5", b"5 5", b"9" * 16],
)
def test_content_length_other_than_ascii_digits_is_refused(declared: bytes) -> None:
    head = parse_head(_head(declared))
    assert head is not None
    refusal = body_length(head, max_body=1 << 20)
    assert isinstance(refusal, Response)
    assert refusal.status in (HTTPStatus.BAD_REQUEST, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


def test_a_plain_content_length_is_still_read() -> None:
    head = parse_head(_head(b"0012"))
    assert head is not None and body_length(head, max_body=16) == 12


def test_header_lines_split_only_at_line_feeds() -> None:
    """Latin-1 NEL (0x85) and the other characters `str.splitlines` breaks at are not
    line ends: a header value cannot smuggle a second header."""
    head = parse_head(b"POST / HTTP/1.1\r\nX-A: a\x85Content-Length: 5\x1cz\r\n\r\n")
    assert head is not None and "content-length" not in head.headers


def test_duplicate_content_lengths_that_differ_are_refused() -> None:
    head = parse_head(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
    assert head is not None
    assert isinstance(body_length(head, max_body=16), Response)


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


def test_a_superscript_content_length_is_answered_400_and_others_still_served(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """Before: int('²') raised ValueError in the I/O thread at every byte."""
    server = serve(_echo, max_body=16, timeout=30)
    attacker = _connect(server)
    attacker.sendall(_head(b"\xb2"))
    assert _answer(attacker).startswith(b"HTTP/1.1 400 ")
    for _ in range(3):
        other = _connect(server)
        other.sendall(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nok")
        assert _answer(other).startswith(b"HTTP/1.1 200 ")
        other.close()
    attacker.close()


def test_an_exception_while_answering_closes_that_connection_only(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """A handler's answer that cannot be rendered (a header outside latin-1) raises in
    the I/O thread: that connection is closed and counted, at once, not at its
    deadline, and the next request is served. One worker: the failing answer is handled
    before the good one."""

    def handler(request: Request) -> Response:
        if request.target == "/bad":
            return Response(HTTPStatus.OK, b"x", content_type="text/plain; charset=\u20ac")
        return Response(HTTPStatus.OK, b"fine")

    server = serve(handler, timeout=30, workers=1)
    bad, good = _connect(server), _connect(server)
    bad.sendall(b"GET /bad HTTP/1.1\r\n\r\n")
    good.sendall(b"GET /good HTTP/1.1\r\n\r\n")
    assert _answer(good).startswith(b"HTTP/1.1 200 ")
    assert _closed(bad), "the connection whose answer failed is still open"
    assert server.stats.failed == 1
    bad.close()
    good.close()


def _never_reading(server: BoundedHttpServer, target: bytes) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"GET " + target + b" HTTP/1.1\r\n\r\n")
    return sock


def _large_answers(request: Request) -> Response:
    size = 16 << 20 if request.target == "/large" else 2
    return Response(HTTPStatus.OK, b"x" * size)


def test_unsent_answers_count_in_the_buffered_budget(
    serve: Callable[..., BoundedHttpServer],
) -> None:
    """Four answers of 16 MiB nobody reads against a 24 MiB budget: the unsent bytes are
    held like request bytes, so clients that do not read are closed to make room."""
    server = serve(_large_answers, timeout=30, max_buffered=24 << 20, workers=1)
    readers = [_never_reading(server, b"/large") for _ in range(4)]
    probe = _connect(server)
    probe.sendall(b"GET /small HTTP/1.1\r\n\r\n")  # one worker: answered after the four
    assert _answer(probe).startswith(b"HTTP/1.1 200 ")
    assert server.stats.evicted >= 2
    assert server.buffered_bytes <= 24 << 20
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
    probe.sendall(b"GET /small HTTP/1.1\r\n\r\n")
    assert _answer(probe).startswith(b"HTTP/1.1 200 ")
    assert server.stats.refused == 0 and server.stats.evicted >= 1
    for sock in [*readers, probe]:
        sock.close()


def test_pipelined_requests_are_each_answered(serve: Callable[..., BoundedHttpServer]) -> None:
    """Two requests in one send on a kept-alive connection. Before: the second was
    answered only once more bytes came, or never (closed at the deadline)."""
    server = serve(_echo, timeout=30, keep_alive=True, max_body=16)
    sock = _connect(server)
    one = b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\none"
    sock.sendall(one + b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\ntwo")
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
    sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n" * 500)
    other = _connect(server)
    other.sendall(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert _answer(other).startswith(b"HTTP/1.1 200 ")
    answers = b""
    while answers.count(b"HTTP/1.1 200 ") < 500:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {answers.count(b'HTTP/1.1 200 ')} answers"
        answers += chunk
    assert server.stats.failed == 0
    sock.close()
    other.close()
