"""The plugin's status socket serving control requests, as `driver.plugin.main` wires
it: `POST /control/<action>` handed to a health monitor's `ControlQueue`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from driver.devices.model import PoolDevices
from driver.health.control_queue import ControlQueue
from driver.health.monitor import HealthMonitor
from driver.observability.status_socket import StatusSocketServer, status_socket_path


@contextlib.contextmanager
def control_socket(state_dir: Path, control: ControlQueue) -> Iterator[Path]:
    """`control` served on the status socket in `state_dir` (a short path: a Unix
    socket's holds at most 107 bytes); yields the socket's path."""
    path = status_socket_path(state_dir)
    server = StatusSocketServer(path, dict, lambda: (True, "ok\n"), control=control.respond)
    with server.start():
        yield path


class ServedMonitor:
    """A health monitor over `pool` with its control requests on the status socket in
    `state_dir`, as the plugin wires them (`start`, `stop`); the subclass sets the
    attributes, `_serving` an empty ExitStack."""

    state_dir: Path
    pool: PoolDevices
    monitor: HealthMonitor
    _serving: contextlib.ExitStack[bool | None]

    def start(self) -> None:
        self.monitor.start()
        self._serving.enter_context(control_socket(self.state_dir, self.monitor.control))

    def stop(self) -> None:
        self._serving.close()
        self.monitor.stop()

    def uuid(self, minor: int) -> str:
        return self.pool.device(f"gpu-{minor}").gpu_uuid
