"""The node-wide serialize lock of prepare and unprepare (`<data dir>/serialize.lock`),
and how every lock file of the data dir is opened (`open_lock_file`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from driver.errors import transient
from driver.state.fileio import DATA_DIR_MODE, UnsafeFileError

LOCK_FILE: Final = "serialize.lock"

_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def open_lock_file(path: Path) -> int:
    """A descriptor of the lock file at `path`, created (0600) if absent. A symlink at
    `path` is refused, never followed (UnsafeFileError, ELOOP: opening through it
    would create or lock the file it names), as is anything but a regular file
    (EINVAL). Other OSErrors propagate."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafeFileError(
                errno.ELOOP, "is a symbolic link; refusing to follow it", str(path)
            ) from err
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError(errno.EINVAL, "is not a regular file; refusing to lock it", str(path))
    return fd


def _process_lock(path: Path) -> threading.Lock:
    key = os.path.realpath(path)
    with _PROCESS_LOCKS_GUARD:
        return _PROCESS_LOCKS.setdefault(key, threading.Lock())


class SerializeLock:
    """Node-wide serialisation of prepare/unprepare: an in-process lock (threads) and
    `flock(LOCK_EX)` on `<data dir>/serialize.lock` (other plugin instances during a
    rolling update). Polled non-blocking so a timeout is possible; released by closing
    the descriptor, so a crashed holder never leaves it held.
    """

    def __init__(
        self, data_dir: Path | str, *, timeout: float = 10.0, poll_interval: float = 0.05
    ) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILE
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._thread_lock = _process_lock(self.path)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold both locks for the duration of the block; transient DriverError on timeout."""
        deadline = time.monotonic() + self.timeout
        if not self._thread_lock.acquire(timeout=max(self.timeout, 0.0)):
            raise transient(f"timed out after {self.timeout}s waiting for the in-process lock")
        try:
            fd = self._lock_file(deadline)
            try:
                yield
            finally:
                os.close(fd)  # releases the flock
        finally:
            self._thread_lock.release()

    def _lock_file(self, deadline: float) -> int:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True, mode=DATA_DIR_MODE)
            fd = open_lock_file(self.path)
        except OSError as err:
            raise transient(f"cannot open lock file {self.path}: {err.strerror or err}") from err
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or (
                    time.monotonic() >= deadline
                ):
                    os.close(fd)
                    if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise transient(
                            f"timed out after {self.timeout}s waiting for {self.path} "
                            "(another plugin instance is preparing or unpreparing)"
                        ) from err
                    raise transient(f"cannot lock {self.path}: {err}") from err
            time.sleep(self.poll_interval)
