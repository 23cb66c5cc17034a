"""The plugin's /metrics + /healthz server stays answerable under idle and slow clients,
and the bounded server under it (shared with the webhook) reads bodies within bounds."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

import pytest

from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    HttpServer,
)
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response
from driver.observability.listeners import listen_tcp

# Seconds to wait for what the server does at once (an answer, a close): only a
# regression waits this long, a busy machine never does. Timeouts the server must not
# wait for are made longer than it.
EVENT_WAIT = 30.0


def _ok() -> tuple[bool, str]:
    return True, "ok\n"


@pytest.fixture
def start() -> Iterator[Callable[..., HttpServer]]:
    servers: list[HttpServer] = []

    def _start(healthy: Callable[[], tuple[bool, str]] = _ok, **kwargs: Any) -> HttpServer:
        # Without kwargs: the default bounds, what the plugin runs (plugin_status.py).
        server = HttpServer(0, healthy, "127.0.0.1", **kwargs).start()
        servers.append(server)
        return server

    yield _start
    for server in servers:
        server.shutdown()


def _get(server: HttpServer, path: str, timeout: float = 5.0) -> tuple[int, bytes, str]:
    url = f"http://127.0.0.1:{server.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(), resp.headers["Content-Type"]
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers["Content-Type"]


def _idle(server: HttpServer, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    address = ("127.0.0.1", server.port)
    return [
        socket.create_connection(address, timeout=10, source_address=(source, 0)) for _ in range(n)
    ]


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Did the server close `sock` (EOF or reset) within `within` seconds?"""
    sock.settimeout(within)
    try:
        data = sock.recv(1024)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    assert data == b"", data
    return True


def _wait(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + EVENT_WAIT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# --- what it serves ---------------------------------------------------------------------


def test_endpoints(start: Callable[..., HttpServer]) -> None:
    state = {"ok": True}
    server = start(lambda: (state["ok"], "detail\n"))
    assert _get(server, "/healthz") == (200, b"detail\n", "text/plain; charset=utf-8")
    state["ok"] = False
    assert _get(server, "/healthz")[0] == 503
    status, body, ctype = _get(server, "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=")
    assert b"# HELP gpu_dra_" in body
    assert _get(server, "/metrics?x=1")[0] == 200
    assert _get(server, "/nope")[0] == 404


def test_head_post_and_a_failing_health_callback(start: Callable[..., HttpServer]) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    server = start(broken)
    assert _get(server, "/healthz")[0] == 500
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/healthz", method="HEAD")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 500
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/healthz", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 405 and err.value.headers["Allow"] == "GET, HEAD"


def _refused(sock: socket.socket) -> bool:
    """Answered 400 and closed by the server."""
    sock.settimeout(EVENT_WAIT)
    answer = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            answer += chunk
    return answer.split(b" ", 2)[1:2] == [b"400"]


def test_garbage_and_oversized_requests_are_closed(start: Callable[..., HttpServer]) -> None:
    server = start()
    (garbage, big) = _idle(server, 2)
    garbage.sendall(b"hello\r\n\r\n")
    assert _refused(garbage)
    big.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000)
    assert _refused(big)
    assert _get(server, "/healthz")[0] == 200
    assert server.stats.bad_requests == 2


# --- bounds -----------------------------------------------------------------------------


def test_defaults_are_bounded() -> None:
    assert 0 < DEFAULT_TIMEOUT <= 5
    assert 0 < DEFAULT_MAX_CONNECTIONS <= 128


def test_health_answers_with_many_idle_connections(start: Callable[..., HttpServer]) -> None:
    """Twice the connection limit of idle clients from two other addresses: no thread
    each, each address held to its cap (its oldest closed for its newest), and the
    probe still answers, the oldest idle connections making room for it: answered while
    none of them has timed out (their timeout outlasts the probes' wait)."""
    server = start(timeout=2 * EVENT_WAIT)
    threads_before = threading.active_count()
    idle = [
        *_idle(server, DEFAULT_MAX_CONNECTIONS, "127.0.0.3"),
        *_idle(server, DEFAULT_MAX_CONNECTIONS, "127.0.0.4"),
    ]
    try:
        _wait(lambda: server.stats.accepted >= len(idle))
        assert threading.active_count() <= threads_before + 1  # the urlopen below: none
        assert server.open_connections <= DEFAULT_MAX_CONNECTIONS
        for _ in range(5):
            status, _, _ = _get(server, "/healthz", timeout=EVENT_WAIT)
            assert status == 200
        assert server.stats.timed_out == 0  # room made by evictions, not timeouts
        assert server.stats.evicted >= 2 * DEFAULT_MAX_CONNECTIONS - server.limits.max_connections
        assert server.stats.refused == 0  # none had a worker: room was made for each
    finally:
        for s in idle:
            s.close()


def test_idle_connection_is_closed_after_the_timeout(start: Callable[..., HttpServer]) -> None:
    server = start(timeout=0.5)
    connecting = time.monotonic()  # the timeout runs from the accept, after this
    (sock,) = _idle(server, 1)
    assert _closed_by_server(sock, within=EVENT_WAIT), "never closed"
    assert time.monotonic() - connecting >= 0.5  # not before its timeout
    _wait(lambda: server.open_connections == 0)
    assert server.stats.timed_out == 1


def test_default_timeout_closes_an_idle_connection(start: Callable[..., HttpServer]) -> None:
    server = start()
    assert server.timeout == DEFAULT_TIMEOUT
    connecting = time.monotonic()
    (sock,) = _idle(server, 1)
    assert _closed_by_server(sock, within=DEFAULT_TIMEOUT + EVENT_WAIT)
    assert time.monotonic() - connecting >= DEFAULT_TIMEOUT
    assert server.stats.timed_out == 1


def test_a_dribbling_client_gets_no_more_than_the_timeout(
    start: Callable[..., HttpServer],
) -> None:
    """One byte every 0.1 s, never idle for the 0.6 s timeout: closed part way through
    the 12 s the whole request takes to dribble (bytes counted, not seconds)."""
    server = start(timeout=0.6)
    (sock,) = _idle(server, 1)
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    sent = 0
    with contextlib.suppress(OSError):  # closed by the server
        for byte in request:
            sock.send(bytes([byte]))
            sent += 1
            time.sleep(0.1)
    assert sent < len(request), "the dribbling client was never closed"
    assert server.stats.timed_out == 1


def test_new_connection_evicts_the_oldest_idle_one(start: Callable[..., HttpServer]) -> None:
    server = start(max_connections=3, timeout=30)
    first, second, third = _idle(server, 3)
    _wait(lambda: server.open_connections == 3)
    (fourth,) = _idle(server, 1)
    assert _closed_by_server(first, within=EVENT_WAIT)  # closed at once
    assert not _closed_by_server(second, within=0.2)
    fourth.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    fourth.settimeout(5)
    assert fourth.recv(1024).startswith(b"HTTP/1.1 200 OK\r\n")
    for s in (first, second, third, fourth):
        s.close()


def test_a_client_that_never_reads_holds_no_worker(start: Callable[..., HttpServer]) -> None:
    """Requests whose answers are never read: the answers wait in the I/O loop (until
    the timeout), the workers stay free for the probe."""
    slow = threading.Event()
    answered_large = [0]

    def healthy() -> tuple[bool, str]:
        if slow.is_set():
            answered_large[0] += 1
            return True, "x" * (4 << 20)
        return True, "ok\n"

    server = start(healthy, workers=1, timeout=2 * EVENT_WAIT)
    slow.set()
    readers = _idle(server, 4)
    for s in readers:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    _wait(lambda: answered_large[0] == len(readers))
    slow.clear()
    # answered before any unread answer timed out (the timeout outlasts this wait)
    assert _get(server, "/healthz", timeout=EVENT_WAIT)[1] == b"ok\n"
    assert server.stats.timed_out == 0
    for s in readers:
        s.close()


def test_shutdown_closes_everything(start: Callable[..., HttpServer]) -> None:
    server = start()
    (sock,) = _idle(server, 1)
    _wait(lambda: server.open_connections == 1)
    server.shutdown()
    assert _closed_by_server(sock, within=EVENT_WAIT)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1)


# --- the bounded server under the webhook (bodies, lanes) -------------------------------


def test_small_requests_have_workers_of_their_own() -> None:
    """Large requests that keep every large-request worker busy (and more queued behind
    them) do not delay a small one: it has its own workers. The first large one is held
    until the small one is answered."""
    handling_large = threading.Event()
    release_large = threading.Event()

    def held_for_large(request: Request) -> Response:
        if len(request.body) > 1024:
            handling_large.set()
            release_large.wait(EVENT_WAIT)
        return Response(HTTPStatus.OK, str(len(request.body)).encode())

    limits = Limits(timeout=10, max_body=1 << 20, small_request=1024, workers=1, large_workers=1)
    server = BoundedHttpServer(listen_tcp("127.0.0.1", 0), held_for_large, limits).start()

    def post(body: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=EVENT_WAIT)
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        return sock

    try:
        large = [post(b"x" * 4096) for _ in range(3)]
        assert handling_large.wait(EVENT_WAIT)  # the first one is being answered
        small = post(b"{}")
        assert small.recv(1024).endswith(b"\r\n\r\n2")  # while the large one is held
        release_large.set()
        assert large[0].recv(1024).endswith(b"\r\n\r\n4096")
        for sock in [*large, small]:
            sock.close()
    finally:
        server.shutdown()


def test_request_bodies_are_read_only_up_to_the_limit() -> None:
    def echo(request: Request) -> Response:
        return Response(HTTPStatus.OK, request.body)

    server = BoundedHttpServer(listen_tcp("127.0.0.1", 0), echo, Limits(max_body=16)).start()
    try:
        for head, expected in [
            (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", b"HTTP/1.1 200 OK"),
            (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\n\r\n", b"HTTP/1.1 413 "),
            (b"POST / HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 411 "),
            (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"HTTP/1.1 411 "),
            (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", b"HTTP/1.0 400 "),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
                b"HTTP/1.0 400 ",
            ),
        ]:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(head)
            answer = sock.recv(4096)
            assert answer.startswith(expected), (head[:60], answer)
            sock.close()
    finally:
        server.shutdown()
