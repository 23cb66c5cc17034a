"""The connections of `driver.observability.bounded_http`: each one's state, and the
table of open ones that says which to close to make room for a new one or for bytes."""

from __future__ import annotations

import enum
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


class Phase(enum.Enum):
    HANDSHAKE = "handshake"
    READING = "reading"
    WORKING = "working"
    WRITING = "writing"


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    peer: str  # the client's address
    deadline: float
    phase: Phase
    inbuf: bytearray = field(default_factory=bytearray)
    held: int = 0  # bytes counted against max_buffered: request bytes, then unsent answer
    out: memoryview | None = None
    close_after: bool = True
    events: int = 0  # what the selector waits for; 0: not registered
    closed: bool = False

    @property
    def sending(self) -> bool:
        return self.phase in (Phase.HANDSHAKE, Phase.READING)

    @property
    def evictable(self) -> bool:
        """Whether closing it to make room costs only a client that is not keeping up:
        one still sending its request (or idle between two), or one whose answer waits
        for it to read. A request a worker has or will answer is never cut short here."""
        return self.sending or self.phase is Phase.WRITING


TlsContext = Callable[[], ssl.SSLContext]


def accepted(
    sock: socket.socket, peer: str, deadline: float, tls: TlsContext | None
) -> Connection | None:
    """A just accepted `sock` as a non-blocking connection (with `tls`, its handshake to
    do); None, the socket closed, where TLS cannot start."""
    sock.setblocking(False)
    if tls is None:
        return Connection(sock, peer, deadline, Phase.READING)
    try:
        wrapped = tls().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    except OSError:
        sock.close()
        return None
    return Connection(wrapped, peer, deadline, Phase.HANDSHAKE)


class ConnectionTable:
    """The open connections, oldest first (a kept-alive one counts from its last answer),
    at most `max_connections`, at most `max_per_peer` from one address."""

    def __init__(self, max_connections: int, max_per_peer: int, max_buffered: int) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.max_buffered = max_buffered
        self.held = 0  # the sum of the connections' `held`
        self._conns: dict[Connection, None] = {}

    def __len__(self) -> int:
        return len(self._conns)

    def __iter__(self) -> Iterator[Connection]:
        return iter(list(self._conns))

    def add(self, conn: Connection) -> None:
        self._conns[conn] = None

    def renew(self, conn: Connection) -> None:
        """`conn` counts as the newest from now on."""
        del self._conns[conn]
        self._conns[conn] = None

    def remove(self, conn: Connection) -> None:
        self.release(conn)
        self._conns.pop(conn, None)

    def hold(self, conn: Connection, size: int) -> Connection | None:
        """Counts `size` more bytes (fewer, if negative) held by `conn`; returns the
        connection to close while more than `max_buffered` are held: the one holding
        the most (the oldest of those), so a small request is the last to go."""
        conn.held += size
        self.held += size
        if self.held <= self.max_buffered:
            return None
        return max((c for c in self._conns if c.held), key=lambda c: c.held, default=None)

    def release(self, conn: Connection) -> None:
        self.held -= conn.held
        conn.held = 0

    def room_for(self, peer: str) -> tuple[bool, Connection | None]:
        """(whether a new connection from `peer` may open, the connection to close first
        for it). A peer at its cap is refused: its flood of new connections can neither
        close another client's nor make the server pay a TLS handshake for each."""
        if sum(c.peer == peer for c in self._conns) >= self.max_per_peer:
            return False, None
        if len(self._conns) < self.max_connections:
            return True, None
        oldest = next((c for c in self._conns if c.evictable), None)
        return oldest is not None, oldest
