"""An HTTP/1.1 server on aiohttp, bounded against idle, slow and flooding clients.

The plugin's /metrics + /healthz endpoint (`driver.observability.http`), its status
socket and the admission webhook (`driver.webhook.server`) listen where clients that
are not the kubelet or the API server may connect; none may be starved by a few cheap
clients. aiohttp (llhttp, its C parser) reads requests: it parses each byte once,
however the head is cut into records or whatever ends its lines, and refuses a request
line or header over 8190 bytes or more than 64 headers (400, closed). It leaves to its
user what this module adds, on aiohttp's event loop, in a thread of its own:

- A deadline per request: `timeout` seconds from the accept (on a kept-alive
  connection: from the previous answer) until the request is with a worker, TLS
  handshake, head and body included; then `timeout` seconds for the answer to be taken
  and the next request sent. Dribbling does not extend it. A request with a worker is
  never cut short.
- At most `max_connections` open, TLS handshakes included, and `max_per_peer` from one
  address. A new connection beyond closes the oldest one without a worker (at the
  address cap: the oldest of that address's own, so that where pods share the API
  server's address a flood from it makes room for the API server instead of refusing
  it); where every one is with a worker, the new one is closed.
- Bodies need a Content-Length (411) of at most `max_body` bytes (413; with 0, bodies
  are not read). One over `small_request` reserves its length from `max_buffered` until
  answered: beyond, 503 at once.
- `workers` threads answer requests of up to `small_request` bytes, `large_workers`
  the larger ones, so large requests never delay a small one by more than the GIL. At
  most `max_queued` (`max_queued_large`) wait: beyond, 503 at once. `probes` (health
  paths) are answered on the event loop itself: busy workers never hold them.
- With `tls`, every connection is TLS (a plain-HTTP client is closed); `tls()` gives
  the context for each new connection (a rotated certificate is used at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Final

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from driver.observability.http_connections import Connection, ConnectionTable
from driver.observability.http_limits import MAX_HEADERS, MAX_REQUEST_HEAD, HttpStats, Limits
from driver.observability.http_messages import Request, Response, body_length
from driver.observability.http_workers import Handler, WorkerLane, run_safely

log = logging.getLogger(__name__)

Probe = Callable[[], Response]  # runs on the event loop: cheap, never blocking
TlsContext = Callable[[], ssl.SSLContext]
_BUSY: Final = Response(HTTPStatus.SERVICE_UNAVAILABLE, b"busy, retry later\n")


class BoundedHttpServer:
    """Serves `handler` within `limits`; see the module docstring."""

    def __init__(
        self,
        listener: socket.socket,
        handler: Handler,
        limits: Limits,
        *,
        tls: TlsContext | None = None,
        name: str = "http",
        probes: Mapping[str, Probe] | None = None,
    ) -> None:
        """Serves on `listener`, a bound and listening socket: one of
        `driver.observability.listeners`; `shutdown()` closes it."""
        self.limits = limits
        self.stats = HttpStats()
        self._handler = handler
        self._probes = dict(probes or {})
        self._tls = tls
        self._name = name
        self._listener = listener
        address = listener.getsockname()  # (host, port[, IPv6's two]) or a path
        self.server_address: tuple[str, int] | str = (
            address[:2] if isinstance(address, tuple) else address
        )
        self._conns = ConnectionTable(limits.max_connections, limits.max_per_peer)
        self._of_protocol: dict[web.RequestHandler, Connection] = {}
        self._small = WorkerLane(f"{name}-worker", limits.workers, limits.max_queued)
        self._large = WorkerLane(f"{name}-large", limits.large_workers, limits.max_queued_large)
        self._reserved = 0  # bytes of large bodies read or being answered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._web: web.Server | None = None
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()
        self._stopping = threading.Event()

    @property
    def port(self) -> int:
        """The TCP port served (0 for a Unix socket)."""
        return self.server_address[1] if isinstance(self.server_address, tuple) else 0

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of large bodies counted against `max_buffered`."""
        return self._reserved

    @property
    def waiting_requests(self) -> int:
        """Requests waiting for a worker."""
        return self._small.waiting + self._large.waiting

    def start(self) -> BoundedHttpServer:
        """Serves in a background thread until `shutdown()`."""
        self._thread = threading.Thread(target=self.serve_forever, name=self._name, daemon=True)
        self._thread.start()
        self._serving.wait()
        return self

    def serve_forever(self) -> None:
        """Serves in the calling thread until `shutdown()` (from another thread)."""
        loop = self._loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(self._listen())
            self._serving.set()
            if not self._stopping.is_set():
                loop.run_forever()
            server.close()
            for conn in self._conns:
                conn.close()
            loop.run_until_complete(_cancel_tasks())
        finally:
            self._serving.set()
            self._small.stop()
            self._large.stop()
            self._listener.close()
            loop.close()

    def shutdown(self) -> None:
        """Stops serving and closes every connection and the listening socket."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        elif self._thread is None and self._loop is None:
            self._listener.close()  # never served

    server_close = shutdown

    def __enter__(self) -> BoundedHttpServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    # -- the event loop's thread from here on ------------------------------------------

    async def _listen(self) -> asyncio.AbstractServer:
        loop = asyncio.get_running_loop()
        self._web = _WebServer(
            self._lost,
            self._serve_request,
            loop=loop,
            access_log=None,
            logger=_ServerLog(self.stats),
            keepalive_timeout=self.limits.timeout,
            max_line_size=MAX_REQUEST_HEAD,
            max_field_size=MAX_REQUEST_HEAD,
            max_headers=MAX_HEADERS,
            lingering_time=0,  # an unread body closes the connection
        )
        if self._listener.family == socket.AF_UNIX:
            return await loop.create_unix_server(lambda: _Accepted(self), sock=self._listener)
        return await loop.create_server(lambda: _Accepted(self), sock=self._listener)

    def _admit(self, transport: asyncio.Transport) -> None:
        """A new connection: counted, timed, and handed to aiohttp (after its TLS
        handshake); or closed, where there is no room for it."""
        self.stats.accepted += 1
        address = transport.get_extra_info("peername")
        peer = str(address[0]) if isinstance(address, tuple) else "unix"  # unnamed
        admit, make_room = self._conns.room_for(peer)
        if make_room is not None:
            self.stats.evicted += 1
            self._drop(make_room)
        if not admit:
            self.stats.refused += 1
            transport.abort()
            return
        assert self._loop is not None
        conn = Connection(transport, peer, self._loop.time() + self.limits.timeout)
        self._conns.add(conn)
        self._arm(conn)
        if self._tls is None:
            self._hand_over(conn, transport)
        else:
            transport.pause_reading()  # nothing is read before the handshake starts
            self._loop.create_task(self._handshake(conn, transport, self._tls()))

    async def _handshake(
        self, conn: Connection, transport: asyncio.Transport, context: ssl.SSLContext
    ) -> None:
        assert self._loop is not None
        if transport.is_closing():  # closed (evicted) before this task started: its
            self._drop(conn)  # connection_lost went to the first protocol, and start_tls
            return  # would wait for the handshake's timeout, holding its buffers
        early = _Early()
        try:
            secure = await self._loop.start_tls(
                transport,
                early,
                context,
                server_side=True,
                ssl_handshake_timeout=max(conn.deadline - self._loop.time(), 0.001),
            )
        except Exception as err:  # a failed or timed-out handshake, plain HTTP, a reset
            log.debug("%s: TLS handshake failed: %s", self._name, err)
            self._drop(conn)
            return
        if secure is None or early.lost:
            self._drop(conn)
            return
        conn.transport = secure
        self._hand_over(conn, secure, bytes(early.data))

    def _hand_over(
        self, conn: Connection, transport: asyncio.Transport, early: bytes = b""
    ) -> None:
        assert self._web is not None
        protocol = self._web()
        self._of_protocol[protocol] = conn
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if early:
            protocol.data_received(early)

    def _lost(self, protocol: web.RequestHandler) -> None:
        conn = self._of_protocol.pop(protocol, None)
        if conn is not None:
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        conn.close()
        self._conns.remove(conn)

    def _arm(self, conn: Connection) -> None:
        assert self._loop is not None
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = self._loop.call_at(conn.deadline, self._expire, conn)

    def _expire(self, conn: Connection) -> None:
        if conn.busy:
            return  # `_answer` gives it a new deadline
        self.stats.timed_out += 1
        self._drop(conn)

    async def _serve_request(self, request: web.BaseRequest) -> web.StreamResponse:
        conn = self._of_protocol.get(request.protocol)
        if conn is None:  # closed (evicted, out of time) since its head was parsed
            return _gone()
        keep_alive = self.limits.keep_alive and request.keep_alive
        probe = self._probes.get(request.path) if request.method in ("GET", "HEAD") else None
        if probe is not None:
            return self._answer(conn, run_safely(probe)[0], keep_alive and not request.body_exists)
        headers = {name.lower(): value for name, value in request.headers.items()}
        body, reserved = b"", 0
        if self.limits.max_body:
            length = body_length(request.method, headers, self.limits.max_body)
            if isinstance(length, Response):
                return self._answer(conn, length, keep_alive=False)
            if length > self.limits.small_request:
                if self._reserved + length > self.limits.max_buffered:
                    self.stats.busy += 1
                    return self._answer(conn, _BUSY, keep_alive=False)
                reserved = length
            self._reserved += reserved
            try:
                if length:
                    body = await request.content.readexactly(length)  # within the deadline
            except (asyncio.IncompleteReadError, ConnectionError, RequestPayloadError):
                self._reserved -= reserved
                return _gone()  # closed while sending its body: nobody to answer
            except BaseException:
                self._reserved -= reserved
                raise
        elif request.body_exists:
            keep_alive = False  # its body stays unread
        lane = self._small if len(body) <= self.limits.small_request else self._large
        conn.busy = True
        try:
            answer = await lane.run(
                self._handler, Request(request.method, request.path_qs, headers, body)
            )
        finally:
            conn.busy = False
            self._reserved -= reserved
        if answer is None:
            self.stats.busy += 1
            return self._answer(conn, _BUSY, keep_alive=False)
        response, failed = answer
        self.stats.failed += failed
        return self._answer(conn, response, keep_alive)

    def _answer(self, conn: Connection, response: Response, keep_alive: bool) -> web.Response:
        """`response` for aiohttp to write; the connection gets `timeout` seconds for
        the answer to be taken and its next request sent."""
        assert self._loop is not None
        self.stats.answered += 1
        conn.deadline = self._loop.time() + self.limits.timeout
        self._conns.renew(conn)
        self._arm(conn)
        headers = {"Content-Type": response.content_type}
        if response.allow:
            headers["Allow"] = response.allow
        answer = web.Response(status=response.status, body=response.body, headers=headers)
        if not keep_alive:
            answer.force_close()
        return answer


class _WebServer(web.Server):
    """aiohttp's server, telling `lost` of each connection it loses."""

    def __init__(self, lost: Callable[[web.RequestHandler], None], *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._on_lost = lost

    def connection_lost(
        self, handler: web.RequestHandler, exc: BaseException | None = None
    ) -> None:
        super().connection_lost(handler, exc)
        self._on_lost(handler)


class _ServerLog:
    """aiohttp's server log. A request its parser refused, or a connection lost, is
    counted and logged in one short debug line: the parser's message repeats the
    request's bytes (megabytes of them, from a client that means harm). Anything else
    is a warning, at most one per `_WARN_EVERY` seconds: clients cannot flood the log
    (a blocked log write would stall the event loop)."""

    _SHOWN: Final = 200
    _WARN_EVERY: Final = 10.0

    def __init__(self, stats: HttpStats) -> None:
        self._stats = stats
        self._warned_at = -self._WARN_EVERY
        self._held_back = 0

    def exception(self, message: str, *args: object, exc_info: object = None, **_: object) -> None:
        text = f"{message % args}: {exc_info!r}"[: self._SHOWN]
        if isinstance(exc_info, HttpProcessingError):
            self._stats.bad_requests += 1
            log.debug("%s", text)
        elif isinstance(exc_info, ConnectionError):
            log.debug("%s", text)
        else:
            self._warn(text)

    def _warn(self, text: str) -> None:
        now = time.monotonic()
        if now - self._warned_at < self._WARN_EVERY:
            self._held_back += 1
            return
        held, self._held_back, self._warned_at = self._held_back, 0, now
        log.warning("%s%s", text, f" ({held} more not logged)" if held else "")

    def debug(self, message: str, *args: object, exc_info: object = None, **_: object) -> None:
        if isinstance(exc_info, HttpProcessingError):  # not HTTP at all: a bad method
            self._stats.bad_requests += 1
        log.debug("%s", (message % args)[: self._SHOWN])

    def warning(self, message: str, *args: object, **_: object) -> None:
        self._warn((message % args)[: self._SHOWN])

    error = warning


class _Accepted(asyncio.Protocol):
    """A connection's first protocol: admits it (`_admit` hands it on at once)."""

    def __init__(self, server: BoundedHttpServer) -> None:
        self._server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._server._admit(transport)


class _Early(asyncio.Protocol):
    """Holds what arrives between the end of a TLS handshake and aiohttp taking over."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


def _gone() -> web.Response:
    """The answer to a request whose connection closed while it was read: never sent."""
    return web.Response(status=HTTPStatus.BAD_REQUEST)


async def _cancel_tasks() -> None:
    await asyncio.sleep(0)  # the closed connections' callbacks run
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
