"""The plugin's two unix-socket gRPC servers, rebuilt when their socket file vanishes.

The kubelet finds the plugin through the registration socket and reaches it through
the DRA service socket. When either file is deleted while the plugin runs (a
cleanup script, an operator, a kubelet that wipes its plugin directories), the
kubelet deregisters the driver, or can no longer dial it, and pods on the node hang
in ContainerCreating/Terminating until the plugin restarts. `SocketWatcher` checks
both files every `interval` seconds (stat of two paths: cheap) and rebuilds the
server of a file that is gone or was replaced by another inode. A lost service
socket also rebuilds the registration socket, so the kubelet registers the plugin
again and re-dials the new service socket at once instead of on its next failure.

A socket is private (0600) from the moment it exists: it is bound under umask 0177.
A chmod after the bind would follow a symlink put in its place meanwhile and change
the mode of whatever that names.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from driver.observability import metrics

log = logging.getLogger(__name__)

DEFAULT_CHECK_INTERVAL = 1.0
# The kubelet runs as root; nobody else needs these sockets: rw for the owner only.
SOCKET_UMASK = 0o177


@dataclass
class BuiltServer:
    """A server with its services added, and what to do before stopping it."""

    server: grpc.Server
    before_stop: Callable[[], None] = lambda: None


class SocketServer:
    """One gRPC server on one unix socket; `build` adds the services to a new server."""

    def __init__(self, name: str, path: Path, build: Callable[[], BuiltServer]) -> None:
        self.name = name
        self.path = path
        self._build = build
        self._current: BuiltServer | None = None
        self._inode: int | None = None

    def start(self) -> None:
        built = self._build()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # grpcio binds in add_insecure_port. The umask is process-wide: what another
        # thread creates in these microseconds is owner-only too (the plugin's state
        # files are 0600 anyway; root still enters a directory made without x bits).
        previous = os.umask(SOCKET_UMASK)
        try:
            built.server.add_insecure_port(f"unix://{self.path}")
        finally:
            os.umask(previous)
        built.server.start()
        self._current = built
        self._inode = os.lstat(self.path).st_ino

    def intact(self) -> bool:
        """Is the socket file this server listens on still at its path?"""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self._inode

    def stop(self, grace: float | None) -> None:
        """Stop serving. grpcio unlinks the socket path on stop, so this must run
        before a replacement binds the same path."""
        current, self._current = self._current, None
        if current is not None:
            current.before_stop()
            current.server.stop(grace).wait()

    def rebuild(self, grace: float | None) -> None:
        self.stop(grace)
        try:  # whatever took the path (grpcio binds over a stale socket, not a file)
            os.unlink(self.path)
            log.warning("removed %s, which had replaced the %s socket", self.path, self.name)
        except FileNotFoundError:
            pass
        self.start()
        metrics.SOCKET_RECREATIONS.labels(socket=self.name).inc()


def new_server(max_workers: int) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))


class SocketWatcher:
    """Rebuilds the service and registration servers when their files vanish."""

    THREAD_NAME = "socket-watcher"

    def __init__(
        self,
        service: SocketServer,
        registration: SocketServer,
        *,
        on_reregister: Callable[[], None],
        interval: float = DEFAULT_CHECK_INTERVAL,
        grace: float = 1.0,
    ) -> None:
        self.service = service
        self.registration = registration
        self._on_reregister = on_reregister
        self._interval = interval
        self._grace = grace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def check_once(self) -> list[str]:
        """Rebuild what is missing; returns the names of the rebuilt sockets."""
        rebuilt: list[str] = []
        if not self.service.intact():
            log.warning("DRA service socket %s is gone; serving it again", self.service.path)
            self.service.rebuild(self._grace)
            rebuilt.append(self.service.name)
        if rebuilt or not self.registration.intact():
            log.warning(
                "registration socket %s %s; creating it again so the kubelet registers the "
                "plugin anew",
                self.registration.path,
                "must be renewed" if rebuilt else "is gone",
            )
            self._on_reregister()
            self.registration.rebuild(0)
            rebuilt.append(self.registration.name)
        return rebuilt

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.check_once()
            except Exception:  # keep watching: the next round may succeed
                log.exception("recreating the plugin's sockets failed")
