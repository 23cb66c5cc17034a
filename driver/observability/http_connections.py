"""The connections of `driver.observability.bounded_http`: each one's state, and the
table of open ones that says which to close to make room for a new one."""

from __future__ import annotations

import enum
import socket
from collections.abc import Iterator
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


class ConnectionTable:
    """The open connections, oldest first (a kept-alive one counts from its last answer),
    at most `max_connections`, at most `max_per_peer` from one address."""

    def __init__(self, max_connections: int, max_per_peer: int) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
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
        self._conns.pop(conn, None)

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
