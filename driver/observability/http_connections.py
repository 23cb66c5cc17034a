"""The open connections of `driver.observability.bounded_http`: each one's deadline and
state, and the table that says which one to close to make room for a new one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Connection:
    transport: asyncio.BaseTransport
    peer: str  # the client's address
    deadline: float  # loop time by which its request (or answer) must be through
    busy: bool = False  # a worker has (or will take) its request: never cut short
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def close(self) -> None:
        """Closes at once, unsent bytes dropped (a client out of time gets nothing more)."""
        if self.timer is not None:
            self.timer.cancel()
        if not self.transport.is_closing():
            if isinstance(self.transport, asyncio.Transport):
                self.transport.abort()
            else:
                self.transport.close()


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
        if self._conns.pop(conn, 0) is None:
            self._conns[conn] = None

    def remove(self, conn: Connection) -> None:
        self._conns.pop(conn, None)

    def room_for(self, peer: str) -> tuple[bool, Connection | None]:
        """(whether a new connection from `peer` may open, the connection to close first
        for it): at `peer`'s cap, the oldest of its own connections that no worker has
        (where pods share an address, e.g. behind SNAT, a flood from it cannot lock out
        the API server's next review); at the table's cap, the oldest of all such. A new
        one is refused only where every candidate is with a worker."""
        own = [c for c in self._conns if c.peer == peer]
        if len(own) >= self.max_per_peer:
            oldest = next((c for c in own if not c.busy), None)
        elif len(self._conns) >= self.max_connections:
            oldest = next((c for c in self._conns if not c.busy), None)
        else:
            return True, None
        return oldest is not None, oldest
