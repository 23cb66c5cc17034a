"""Busy clients cannot fill the bounded server's table (issue 34, item 3): a per-peer
connection cap, bounded worker queues that answer 503, probes answered by the I/O
thread, /metrics rendered at most about once a second. Blocked handlers make every
state explicit; nothing here depends on how long a step takes."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

import pytest

from driver.observability.bounded_http import BoundedHttpServer
from driver.observability.http import CachedRender, HttpServer
from driver.observability.http_limits import Limits
from driver.observability.http_messages import Request, Response
from driver.observability.listeners import listen_tcp

pytestmark = pytest.mark.timeout(60)


class Blocker:
    """A handler that holds requests for /block until `release` is set; `entered`
    counts those that reached it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = 0

    def __call__(self, request: Request) -> Response:
        if request.path == "/block":
            self.entered += 1
            self.release.wait(30)
        return Response(HTTPStatus.OK, request.path.encode() + b":" + request.body)


@pytest.fixture
def blocker() -> Iterator[Blocker]:
    handler = Blocker()
    yield handler
    handler.release.set()


@pytest.fixture
def serve() -> Iterator[Callable[..., BoundedHttpServer]]:
    servers: list[BoundedHttpServer] = []

    def _serve(handler: Callable[[Request], Response], **kwargs: Any) -> BoundedHttpServer:
        probes = kwargs.pop("probes", None)
        limits = Limits(timeout=30, **kwargs)
        server = BoundedHttpServer(
            listen_tcp("127.0.0.1", 0), handler, limits, probes=probes
        ).start()
        servers.append(server)
        return server

    yield _serve
    for server in servers:
        server.shutdown()


def _send(port: int, data: bytes, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sock.sendall(data)
    return sock


def _get(port: int, path: str, source: str = "127.0.0.1") -> socket.socket:
    return _send(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), source)


def _post(port: int, body: bytes) -> socket.socket:
    return _send(
        port, b"POST /q HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
        if b"\r\n\r\n" in data:
            head, body = data.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(body) >= length:
                break
    return data


def _wait_for(predicate: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(3000):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError("condition never reached")


def test_one_peer_cannot_take_every_connection(
    serve: Callable[..., BoundedHttpServer], blocker: Blocker
) -> None:
    """Eight requests from one address that keep their workers busy: at most four of
    them hold a connection, and a client from another address is answered. Before,
    all eight held the whole table and the other client was refused."""
    server = serve(blocker, max_connections=8, max_per_peer=4, workers=8)
    busy = [_get(server.port, "/block") for _ in range(8)]
    _wait_for(lambda: server.stats.accepted == 8)
    other = _get(server.port, "/other", source="127.0.0.2")
    assert _answer(other).endswith(b"/other:")
    assert server.stats.refused + server.stats.evicted >= 4
    for sock in [*busy, other]:
        sock.close()


def test_a_full_queue_answers_503_instead_of_holding_the_connection(
    serve: Callable[..., BoundedHttpServer], blocker: Blocker
) -> None:
    server = serve(blocker, workers=1, max_queued=2)
    working = _get(server.port, "/block")
    _wait_for(lambda: server.stats.accepted == 1 and blocker.entered == 1)
    queued = [_get(server.port, "/block") for _ in range(2)]
    _wait_for(lambda: server.waiting_requests == 2)
    refused = _get(server.port, "/block")
    assert _answer(refused).startswith(b"HTTP/1.1 503 ")
    blocker.release.set()
    for sock in [working, *queued]:
        assert _answer(sock).startswith(b"HTTP/1.1 200 ")
        sock.close()
    refused.close()


def test_a_smaller_request_takes_the_place_of_the_largest_queued_one(
    serve: Callable[..., BoundedHttpServer], blocker: Blocker
) -> None:
    """The queue is full of large requests: a small one still gets in; the newest of the
    largest is answered 503 instead, and the small one is answered first."""
    server = serve(blocker, workers=1, max_queued=2, max_body=1 << 16)
    working = _get(server.port, "/block")
    _wait_for(lambda: server.stats.accepted == 1 and blocker.entered == 1)
    large = [_post(server.port, b"L" * 4096) for _ in range(2)]
    _wait_for(lambda: server.waiting_requests == 2)
    small = _post(server.port, b"s")
    assert _answer(large[1]).startswith(b"HTTP/1.1 503 ")
    blocker.release.set()
    assert _answer(small).endswith(b"/q:s")
    assert _answer(large[0]).endswith(b"L" * 4096)
    for sock in [working, *large, small]:
        sock.close()


def test_probes_are_answered_while_every_worker_is_busy(
    serve: Callable[..., BoundedHttpServer], blocker: Blocker
) -> None:
    server = serve(
        blocker,
        workers=1,
        probes={"/healthz": lambda: Response(HTTPStatus.OK, b"ok")},
    )
    busy = [_get(server.port, "/block") for _ in range(3)]
    _wait_for(lambda: blocker.entered == 1)
    probe = _get(server.port, "/healthz")
    assert _answer(probe).endswith(b"\r\n\r\nok")
    for sock in [*busy, probe]:
        sock.close()


def test_the_plugin_answers_healthz_while_readyz_is_being_computed(blocker: Blocker) -> None:
    """Before: /healthz waited for the worker that /status (now /readyz) held."""
    server = HttpServer(0, lambda: (True, "fine\n"), "127.0.0.1", workers=1).start()
    try:
        server.serve_readiness(
            lambda: (blocker(Request("GET", "/block", {})).status == 200, "done")
        )
        status = _get(server.port, "/readyz")
        _wait_for(lambda: blocker.entered == 1)
        assert _answer(_get(server.port, "/healthz")).endswith(b"\r\n\r\nfine\n")
        blocker.release.set()
        assert _answer(status).endswith(b"\r\n\r\ndone")
    finally:
        server.shutdown()


def test_a_render_is_reused_only_when_asked_and_younger_than_max_age() -> None:
    now = [100.0]
    renders: list[float] = []

    def render() -> bytes:
        renders.append(now[0])
        return f"metrics at {now[0]}".encode()

    cached = CachedRender(render, max_age=1.0, clock=lambda: now[0])
    assert cached(reuse=True) == b"metrics at 100.0"
    now[0] = 100.9
    assert cached(reuse=True) == b"metrics at 100.0"
    assert cached(reuse=False) == b"metrics at 100.9"
    now[0] = 101.9
    assert cached(reuse=True) == b"metrics at 101.9"
    assert renders == [100.0, 100.9, 101.9]


def test_metrics_are_rendered_once_for_the_requests_that_waited(
    blocker: Blocker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four /metrics requests wait behind a blocked /readyz: the first renders, the
    next two (others still waiting) reuse it, the last (none waiting) renders afresh,
    as does every request to an idle server."""
    renders: list[int] = []

    def counting(registry: object) -> bytes:
        renders.append(1)
        return b"metrics %d\n" % len(renders)

    monkeypatch.setattr("driver.observability.http.generate_latest", counting)
    server = HttpServer(0, lambda: (True, "ok\n"), "127.0.0.1", workers=1).start()
    try:
        server.serve_readiness(
            lambda: (blocker(Request("GET", "/block", {})).status == 200, "done")
        )
        status = _get(server.port, "/readyz")
        _wait_for(lambda: blocker.entered == 1)
        waiting = [_get(server.port, "/metrics") for _ in range(4)]
        _wait_for(lambda: server.waiting_requests == 4)
        blocker.release.set()
        _answer(status)
        bodies = [_answer(s).rsplit(b"\r\n\r\n", 1)[1] for s in waiting]
        assert bodies == [b"metrics 1\n"] * 3 + [b"metrics 2\n"]
        for i in range(3, 5):  # idle: fresh
            assert _answer(_get(server.port, "/metrics")).endswith(b"metrics %d\n" % i)
    finally:
        server.shutdown()
