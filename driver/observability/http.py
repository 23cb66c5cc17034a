"""The plugin's HTTP endpoint: /metrics for Prometheus, /healthz for the liveness probe.

The port is reachable from every pod that may talk to the plugin pod, so the server is
bounded against idle and slow clients (a thread-per-connection server without a
timeout could be starved by idle connections until the liveness probe fails):

- One I/O thread multiplexes every connection (`selectors`): an idle connection costs
  a socket and a small buffer, never a thread.
- Each connection has `timeout` seconds (default 5) from its accept to deliver its
  request head, and again `timeout` seconds to take the response; then it is closed.
  Dribbling one byte at a time does not extend it (a deadline, not an idle timer).
- At most `max_connections` (default 64) are open. A connection beyond that closes,
  at once, the oldest one still waiting for its request, so that a flood of idle
  connections cannot lock out the probe (which sends its request right after
  connecting); if none is waiting, the new connection is closed instead.
- `workers` threads (default 2) compute the answers (the health callback,
  `generate_latest`); the I/O thread writes them without blocking, so a client that
  never reads its response holds no thread.
- One request per connection (`Connection: close`), a request head of at most 8 KiB,
  GET and HEAD only.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from driver.observability.metrics import REGISTRY

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT: Final = 5.0
DEFAULT_MAX_CONNECTIONS: Final = 64
DEFAULT_WORKERS: Final = 2
MAX_REQUEST_HEAD: Final = 8192
_ACCEPTS_PER_WAKEUP: Final = 8  # well below max_connections: reads in between

Healthy = Callable[[], tuple[bool, str]]


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None
    reading: bool = True  # still waiting for its request head
    closed: bool = False


@dataclass
class HttpStats:
    accepted: int = 0
    answered: int = 0
    timed_out: int = 0  # closed at their deadline
    evicted: int = 0  # idle ones closed to make room for a new connection
    refused: int = 0  # new ones closed at once: the limit was reached, none idle
    bad_requests: int = 0


class HttpServer:
    """Serves /metrics and /healthz; see the module docstring for the bounds."""

    def __init__(
        self,
        port: int,
        healthy: Healthy,
        host: str = "",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        if timeout <= 0 or max_connections < 1 or workers < 1:
            raise ValueError("timeout, max_connections and workers must be positive")
        self._healthy = healthy
        self.timeout = timeout
        self.max_connections = max_connections
        self.stats = HttpStats()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.server_address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[_Connection, None] = {}  # insertion order = accept order
        self._jobs: queue.SimpleQueue[tuple[_Connection, str, str] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[_Connection, bytes]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._workers = [
            threading.Thread(target=self._work, name=f"http-worker-{i}", daemon=True)
            for i in range(workers)
        ]
        self._loop = threading.Thread(target=self._run, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def start(self) -> HttpServer:
        for worker in self._workers:
            worker.start()
        self._loop.start()
        return self

    def shutdown(self) -> None:
        """Stops serving and closes every connection and the listening socket."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        if self._loop.is_alive():
            self._loop.join(timeout=5)
        for _ in self._workers:
            self._jobs.put(None)
        for conn in list(self._conns):
            self._close(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    server_close = shutdown

    # -- I/O thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._once()
            except Exception:  # never let one bad connection stop the endpoint
                log.exception("HTTP server loop error")
                time.sleep(0.1)

    def _once(self) -> None:
        now = time.monotonic()
        wait = min((c.deadline for c in self._conns), default=now + 1.0) - now
        for key, events in self._selector.select(max(0.0, min(wait, 1.0))):
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
            elif isinstance(key.data, _Connection):
                if events & selectors.EVENT_READ:
                    self._read(key.data)
                elif events & selectors.EVENT_WRITE:
                    self._write(key.data)
        while True:
            try:
                conn, response = self._done.get_nowait()
            except queue.Empty:
                break
            if not conn.closed:
                conn.out = memoryview(response)
                conn.deadline = time.monotonic() + self.timeout
                self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
        now = time.monotonic()
        for conn in [c for c in self._conns if c.deadline <= now]:
            self.stats.timed_out += 1
            self._close(conn)

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # e.g. EMFILE: leave the rest in the backlog
                log.warning("HTTP accept failed: %s", err)
                return
            self.stats.accepted += 1
            if len(self._conns) >= self.max_connections:
                idle = next((c for c in self._conns if c.reading), None)
                if idle is None:
                    self.stats.refused += 1
                    sock.close()
                    continue
                self.stats.evicted += 1
                self._close(idle)
            sock.setblocking(False)
            conn = _Connection(sock, time.monotonic() + self.timeout)
            self._conns[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.head += data
        end = conn.head.find(b"\r\n\r\n")
        if end < 0:
            end = conn.head.find(b"\n\n")
        if end < 0:
            if len(conn.head) > MAX_REQUEST_HEAD:
                self.stats.bad_requests += 1
                self._close(conn)
            return
        request_line = bytes(conn.head[: conn.head.find(b"\n")]).decode("latin-1").strip()
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self.stats.bad_requests += 1
            self._close(conn)
            return
        conn.reading = False
        conn.head = bytearray()
        self._selector.unregister(conn.sock)
        self._jobs.put((conn, parts[0], parts[1]))

    def _write(self, conn: _Connection) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self.stats.answered += 1
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- workers -----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, method, target = job
            try:
                response = self._answer(method, target)
            except Exception:
                log.exception("HTTP handler error")
                response = _response(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n")
            self._done.put((conn, response))
            self._wake()

    def _answer(self, method: str, target: str) -> bytes:
        if method not in ("GET", "HEAD"):
            return _response(HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", allow="GET, HEAD")
        path = target.split("?", 1)[0]
        if path == "/metrics":
            status, body, ctype = HTTPStatus.OK, generate_latest(REGISTRY), CONTENT_TYPE_LATEST
        elif path == "/healthz":
            ok, detail = self._healthy()
            status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
            body, ctype = detail.encode(), "text/plain; charset=utf-8"
        else:
            status, body, ctype = HTTPStatus.NOT_FOUND, b"not found\n", "text/plain"
        return _response(status, body, ctype, head_only=method == "HEAD")


def _response(
    status: HTTPStatus,
    body: bytes,
    content_type: str = "text/plain",
    *,
    head_only: bool = False,
    allow: str | None = None,
) -> bytes:
    lines = [
        f"HTTP/1.1 {status.value} {status.phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if allow:
        lines.append(f"Allow: {allow}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


def serve_http(port: int, healthy: Healthy, host: str = "") -> HttpServer:
    """Starts serving with the default bounds in background threads; `shutdown()` stops
    it (`HttpServer(...).start()` for other bounds)."""
    return HttpServer(port, healthy, host).start()
