"""The plugin's status socket serving control requests, as `driver.plugin.main` wires
it: `POST /control/<action>` handed to a health monitor's `ControlQueue`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from driver.health.control_queue import ControlQueue
from driver.observability.status_socket import StatusSocketServer, status_socket_path


@contextlib.contextmanager
def control_socket(state_dir: Path, control: ControlQueue) -> Iterator[Path]:
    """`control` served on the status socket in `state_dir` (a short path: a Unix
    socket's holds at most 107 bytes); yields the socket's path."""
    path = status_socket_path(state_dir)
    server = StatusSocketServer(path, dict, lambda: (True, "ok\n"), control=control.respond)
    with server.start():
        yield path
