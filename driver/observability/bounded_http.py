"""An HTTP/1.1 server bounded against idle, slow and flooding clients (standard library).

The plugin's /metrics + /healthz endpoint (`driver.observability.http`) and the
admission webhook (`driver.webhook.server`) listen on ports that any pod allowed to
open a connection can reach; neither may be starved by a few cheap clients:

- One I/O thread multiplexes every connection (`selectors`): an idle or slow
  connection costs a socket and its buffer, never a thread.
- Each request has `timeout` seconds from the accept (on a kept-alive connection: from
  the previous answer) until it is answered, TLS handshake, head and body included;
  the answer then has `timeout` seconds to be taken. Dribbling one byte at a time does
  not extend it (a deadline, not an idle timer).
- At most `max_connections` are open. A connection beyond that closes, at once, the
  oldest one still sending its request (idle ones included) or not taking its answer,
  so that a flood of slow connections cannot lock out a client that sends its request
  as soon as it connects; if there is none, the new connection is closed instead. At
  most `max_per_peer` are from one address: beyond, a new one from it is closed at once
  (it neither evicts another client's nor costs a TLS handshake).
- A request head of at most 8 KiB; a body of at most `max_body` bytes (413 beyond; with
  0, bodies are not read). At most `max_buffered` bytes of requests not yet answered
  and of answers not yet taken are held in all (those being answered may add a body
  per worker): past that, the connection holding the most (still sending, waiting for
  a worker, or not reading its answer) is closed, so a small request is the last to go.
- `workers` threads answer requests of up to `small_request` bytes, `large_workers`
  the larger ones, smallest first: large requests never delay a small one by more than
  the GIL. At most `max_queued` (`max_queued_large`) wait: beyond, the largest is
  answered 503 at once, so requests waiting for a worker (never evicted) cannot fill
  the table. `probes` (health paths) are answered by the I/O thread itself, which
  writes every answer without blocking: a client that does not read holds no thread.
- An exception while one connection is handled closes that connection only (counted
  in `stats.failed`); the I/O thread never pauses. Pipelined requests are answered in
  turn, at most `_ANSWERS_PER_TURN` before the other connections' turn.
- With `tls`, every connection is TLS: the I/O thread does the handshake without
  blocking, within the request's deadline; a plain-HTTP client is closed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Final

from driver.observability.http_connections import (
    Connection,
    ConnectionTable,
    Phase,
    TlsContext,
    accepted,
)
from driver.observability.http_limits import HttpStats, Limits
from driver.observability.http_messages import BadRequest, Response, render, take_request
from driver.observability.http_workers import Handler, Job, WorkerLane, respond

log = logging.getLogger(__name__)

_READ_CHUNK: Final = 65536
_ACCEPTS_PER_WAKEUP: Final = 8  # well below max_connections: reads in between
_ANSWERS_PER_TURN: Final = 8  # answers written to one connection before the others'

Probe = Callable[[], Response]  # answered by the I/O thread itself: cheap, never blocking
_BUSY: Final = Response(HTTPStatus.SERVICE_UNAVAILABLE, b"busy, retry later\n")
_closed = operator.attrgetter("closed")


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
        self._probes = dict(probes or {})
        self.stats = HttpStats()
        self._tls = tls
        self._name = name
        self._listener = listener
        self._listener.setblocking(False)
        address = self._listener.getsockname()  # (host, port[, IPv6's two]) or a path
        self.server_address: tuple[str, int] | str = (
            address[:2] if isinstance(address, tuple) else address
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns = ConnectionTable(
            limits.max_connections, limits.max_per_peer, limits.max_buffered
        )
        self._next_turn: set[Connection] = set()  # more requests buffered than one turn takes
        self._done: queue.SimpleQueue[tuple[Job[Connection], Response]] = queue.SimpleQueue()
        self._small = self._lane(f"{name}-worker", limits.workers, handler, limits.max_queued)
        self._large = self._small
        if limits.max_body > limits.small_request:
            self._large = self._lane(
                f"{name}-large", limits.large_workers, handler, limits.max_queued_large
            )
        self._stopping = threading.Event()
        self._loop_idle = threading.Event()
        self._loop_idle.set()

    @property
    def port(self) -> int:
        """The TCP port served (0 for a Unix socket)."""
        return self.server_address[1] if isinstance(self.server_address, tuple) else 0

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    @property
    def buffered_bytes(self) -> int:
        """Bytes counted against `max_buffered`: requests not yet answered, answers
        not yet taken."""
        return self._conns.held

    @property
    def waiting_requests(self) -> int:
        """Requests waiting for a worker."""
        large = self._large.waiting if self._large is not self._small else 0
        return self._small.waiting + large

    def start(self) -> BoundedHttpServer:
        """Serves in background threads until `shutdown()`."""
        self._begin()
        threading.Thread(target=self._run, name=self._name, daemon=True).start()
        return self

    def serve_forever(self) -> None:
        """Serves in the calling thread until `shutdown()` (from another thread)."""
        self._begin()
        self._run()

    def shutdown(self) -> None:
        """Stops serving and closes every connection and the listening socket."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        self._loop_idle.wait(timeout=5)
        self._small.stop()
        if self._large is not self._small:
            self._large.stop()
        for conn in self._conns:
            self._close(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    server_close = shutdown

    def __enter__(self) -> BoundedHttpServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def _begin(self) -> None:
        self._small.start()
        self._large.start()
        self._loop_idle.clear()

    def _lane(
        self, name: str, workers: int, handler: Handler, queued: int
    ) -> WorkerLane[Connection]:
        return WorkerLane(name, workers, handler, self._finished, _closed, queued)

    def _finished(self, job: Job[Connection], response: Response) -> None:  # in a worker
        self._done.put((job, response))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- the I/O thread from here on ---------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._once()
                except Exception:  # not one connection's: log it and serve on, never sleep
                    log.exception("%s server loop error", self._name)
        finally:
            self._loop_idle.set()

    def _once(self) -> None:
        now = time.monotonic()
        wait = min((c.deadline for c in self._conns), default=now + 1.0) - now
        postponed, self._next_turn = self._next_turn, set()
        try:
            for conn in postponed:  # their next request is buffered: no event will come
                self._guarded(conn, functools.partial(self._advance, conn))
            for key, _ in self._selector.select(
                0.0 if self._next_turn else max(0.0, min(wait, 1.0))
            ):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                elif isinstance(key.data, Connection):
                    self._guarded(key.data, functools.partial(self._advance, key.data))
            self._deliver_answers()
        finally:
            self._close_expired()

    def _deliver_answers(self) -> None:
        while True:
            try:
                job, response = self._done.get_nowait()
            except queue.Empty:
                return
            conn, head_only = job.client, job.request.method == "HEAD"
            if not conn.closed:
                self._guarded(
                    conn, functools.partial(self._reply, conn, response, head_only=head_only)
                )

    def _close_expired(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns if c.deadline <= now]:
            self.stats.timed_out += 1
            self._close(conn)

    def _guarded(self, conn: Connection, step: Callable[[], None]) -> None:
        """Runs `step` of `conn`'s handling; an exception closes `conn`, and only it."""
        try:
            step()
        except Exception:
            self.stats.failed += 1
            log.exception("%s: closing a connection whose handling failed", self._name)
            self._close(conn)

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # e.g. EMFILE: leave the rest in the backlog
                log.warning("%s accept failed: %s", self._name, err)
                return
            self.stats.accepted += 1
            peer = str(address[0]) if isinstance(address, tuple) else "unix"  # unnamed
            admit, make_room = self._conns.room_for(peer)
            if not admit:
                self.stats.refused += 1
                sock.close()
                continue
            if make_room is not None:
                self.stats.evicted += 1
                self._close(make_room)
            conn = accepted(sock, peer, time.monotonic() + self.limits.timeout, self._tls)
            if conn is not None:
                self._conns.add(conn)
                self._listen(conn, selectors.EVENT_READ)

    def _advance(self, conn: Connection) -> None:
        """Takes `conn` as far as it goes without blocking: the handshake, reading and
        dispatching requests, writing answers; at most `_ANSWERS_PER_TURN` of them (a
        kept-alive client pipelining probes), then the others' turn."""
        answered = self.stats.answered
        try:
            while not conn.closed:
                if conn.phase is Phase.HANDSHAKE:
                    assert isinstance(conn.sock, ssl.SSLSocket)
                    conn.sock.do_handshake()
                    conn.phase = Phase.READING
                    self._listen(conn, selectors.EVENT_READ)
                elif conn.phase is Phase.READING:
                    if self.stats.answered - answered >= _ANSWERS_PER_TURN:
                        self._next_turn.add(conn)
                        return
                    self._read(conn)
                elif conn.phase is Phase.WRITING:
                    self._write(conn)
                else:
                    return  # WORKING: a worker has its request
        except ssl.SSLWantReadError:
            self._listen(conn, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._listen(conn, selectors.EVENT_WRITE)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as err:  # ssl.SSLError included: a failed handshake, plain HTTP
            log.debug("%s connection closed: %s", self._name, err)
            self._close(conn)

    def _listen(self, conn: Connection, events: int) -> None:
        if conn.closed or conn.events == events:
            return
        if conn.events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.events = events

    def _mute(self, conn: Connection) -> None:
        if conn.events:
            conn.events = 0
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)

    def _read(self, conn: Connection) -> None:
        """Reads until a request is complete and dispatched; raises when it would block."""
        while conn.phase is Phase.READING and not conn.closed:
            if conn.inbuf:  # a pipelined request may be complete already
                self._dispatch(conn)
                if conn.phase is not Phase.READING:
                    return
            data = conn.sock.recv(_READ_CHUNK)  # raises when it would block
            if not data:
                self._close(conn)
                return
            conn.inbuf += data
            self._hold(conn, len(data))

    def _hold(self, conn: Connection, size: int) -> None:
        while (largest := self._conns.hold(conn, size)) is not None:
            self.stats.evicted += 1
            self._close(largest)
            size = 0

    def _dispatch(self, conn: Connection) -> None:
        """Hands the request in `conn.inbuf` to a worker once it is complete."""
        try:
            taken = take_request(conn.inbuf, self.limits.max_body)
        except BadRequest:
            self.stats.bad_requests += 1
            self._close(conn)
            return
        if taken is None:
            return
        if isinstance(taken, Response):
            self._answer(conn, taken, close=True)
            return
        request, keep_alive = taken
        conn.close_after = not (self.limits.keep_alive and keep_alive)
        probe = self._probes.get(request.path) if request.method in ("GET", "HEAD") else None
        if probe is not None:
            self._answer(conn, respond(probe), head_only=request.method == "HEAD")
            return
        conn.phase = Phase.WORKING
        self._mute(conn)
        lane = self._small if len(request.body) <= self.limits.small_request else self._large
        left_out = lane.put(Job(conn, request))
        if left_out is not None:
            self.stats.busy += 1
            busy = functools.partial(self._reply, left_out.client, _BUSY, close=True)
            self._guarded(left_out.client, busy)

    def _answer(
        self, conn: Connection, response: Response, *, close: bool = False, head_only: bool = False
    ) -> None:
        conn.close_after = conn.close_after or close
        conn.out = memoryview(render(response, close=conn.close_after, head_only=head_only))
        conn.phase = Phase.WRITING
        conn.deadline = time.monotonic() + self.limits.timeout
        self._conns.release(conn)  # the request's bytes; `_write` holds the unsent answer's
        self._listen(conn, selectors.EVENT_WRITE)

    def _reply(
        self, conn: Connection, response: Response, *, close: bool = False, head_only: bool = False
    ) -> None:
        """Answers a request that waited for a worker, and starts writing the answer."""
        self._answer(conn, response, close=close, head_only=head_only)
        self._advance(conn)

    def _write(self, conn: Connection) -> None:
        assert conn.out is not None
        try:
            while conn.out:
                sent = conn.sock.send(conn.out)  # raises when it would block
                conn.out = conn.out[sent:]
        finally:
            # What the client has not taken yet is held like a request: a client that
            # does not read is the one closed when the budget runs out.
            self._hold(conn, len(conn.out) - conn.held)
        self.stats.answered += 1
        if conn.close_after:
            self._close(conn)
            return
        # Kept alive: the next request gets a fresh deadline and counts as the newest.
        conn.phase = Phase.READING
        conn.deadline = time.monotonic() + self.limits.timeout
        self._conns.renew(conn)
        self._listen(conn, selectors.EVENT_READ)
        if conn.inbuf:  # pipelined: `_read` dispatches it before reading more
            self._hold(conn, len(conn.inbuf))

    def _close(self, conn: Connection) -> None:
        if conn.closed:
            return
        self._mute(conn)
        conn.closed = True
        self._conns.remove(conn)
        conn.sock.close()
