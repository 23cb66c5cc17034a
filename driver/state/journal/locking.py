"""The node-wide serialize lock of prepare and unprepare (`<data dir>/serialize.lock`),
the claim locks of requests in flight outside it (`<data dir>/inflight-<uid>.lock`),
and how every lock file of the data dir is opened (`open_lock_file`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

from driver.errors import transient
from driver.fileio import DATA_DIR_MODE, open_nofollow

LOCK_FILE: Final = "serialize.lock"

_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def open_lock_file(path: Path, *, create: bool = True) -> int:
    """A descriptor of the lock file at `path`, created (0600) if absent and `create`
    (else FileNotFoundError). A symlink at `path` is refused, never followed
    (UnsafeFileError, ELOOP: opening through it would create or lock the file it
    names), as is anything but a regular file (EINVAL). Other OSErrors propagate."""
    return open_nofollow(path, os.O_RDWR | (os.O_CREAT if create else 0), use="lock")


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
        with _PROCESS_LOCKS_GUARD:  # one per data dir
            key = os.path.realpath(self.path)
            self._thread_lock = _PROCESS_LOCKS.setdefault(key, threading.Lock())
        self._closed: str | None = None  # why no hold is granted any more

    def close(self, reason: str) -> None:
        """Grant no hold from now on: each later `hold()` (one waiting for the lock
        too) raises a transient DriverError saying `reason`. The plugin's clean stop
        closes it, holding it, once the journal is compacted: a call still in flight
        then stores nothing after that."""
        self._closed = reason

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold both locks for the duration of the block; transient DriverError on
        timeout, or once the lock is closed."""
        deadline = time.monotonic() + self.timeout
        if not self._thread_lock.acquire(timeout=self.timeout):
            raise transient(f"timed out after {self.timeout}s waiting for the in-process lock")
        try:
            if self._closed is not None:
                raise transient(self._closed)
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
        try:
            while not (locked := _try_flock(fd)) and time.monotonic() < deadline:
                time.sleep(self.poll_interval)
        except OSError as err:
            os.close(fd)
            raise transient(f"cannot lock {self.path}: {err}") from err
        if not locked:
            os.close(fd)
            raise transient(
                f"timed out after {self.timeout}s waiting for {self.path} "
                "(another plugin instance is preparing or unpreparing)"
            )
        return fd


CLAIM_LOCK_PREFIX: Final = "inflight-"
CLAIM_LOCK_SUFFIX: Final = ".lock"
_TAKE_TRIES: Final = 20  # a probe holds a free lock for microseconds: retried, 1 ms apart


class ClaimLocks:
    """Which claims have a prepare or unprepare in flight outside the node lock (its
    MIG devices being created or destroyed): `flock(LOCK_EX)` on
    `<data dir>/inflight-<claim uid>.lock`, held from before the request leaves the
    node lock until its last journal store. The file exists only while held (or when
    a crash left it: then nobody holds it, and the next probe removes it); a crashed
    holder releases it with its descriptor, so a `PrepareStarted` entry whose claim
    lock is free is a crash's leftover and one whose lock is held is in flight.

    Lock order: a claim lock is taken (`ClaimHolds.take`) only while holding the node
    lock and without blocking; a request waits for one (`wait_free`) only while
    holding no lock. Holders of claim locks may wait for the node lock.
    """

    def __init__(self, data_dir: Path | str) -> None:
        self.data_dir = Path(data_dir)

    def path(self, uid: str) -> Path:
        return self.data_dir / f"{CLAIM_LOCK_PREFIX}{uid.replace('/', '_')}{CLAIM_LOCK_SUFFIX}"

    def busy(self, uid: str) -> bool:
        """Does a live request hold the claim's lock? A file nobody holds (a crash's)
        is removed. Never creates the file."""
        path = self.path(uid)
        try:
            fd = open_lock_file(path, create=False)
        except FileNotFoundError:
            return False
        try:
            if not _try_flock(fd):
                return True
            if _same_file(fd, path):
                os.unlink(path)  # ours for the moment: nobody else may unlink it
            return False
        finally:
            os.close(fd)

    def wait_free(self, uids: Iterable[str], deadline: float) -> bool:
        """Wait, holding no lock, until no request holds any of the claims' locks;
        False once `deadline` (time.monotonic) has passed."""
        pending = set(uids)
        while time.monotonic() < deadline:
            pending = {uid for uid in pending if self.busy(uid)}
            if not pending:
                return True
            time.sleep(0.005)
        return False

    def sweep(self) -> list[str]:
        """Remove the lock files of claims nobody holds (left by a crash); returns the
        claims whose lock is held (their requests are in flight)."""
        try:
            names = os.listdir(self.data_dir)
        except FileNotFoundError:
            return []
        uids = [
            n[len(CLAIM_LOCK_PREFIX) : -len(CLAIM_LOCK_SUFFIX)]
            for n in names
            if n.startswith(CLAIM_LOCK_PREFIX) and n.endswith(CLAIM_LOCK_SUFFIX)
        ]
        return sorted(uid for uid in uids if self.busy(uid))

    @contextlib.contextmanager
    def round(self) -> Iterator[ClaimHolds]:
        """The claim locks one round of a request takes, all released at its end."""
        holds = ClaimHolds(self)
        try:
            yield holds
        finally:
            holds.release()


class ClaimHolds:
    """The claim locks a request holds (`ClaimLocks.round`)."""

    def __init__(self, locks: ClaimLocks) -> None:
        self._locks = locks
        self._held: dict[str, int] = {}

    def take(self, uid: str) -> bool:
        """Hold the claim's lock, without blocking (the caller holds the node lock):
        False if another request holds it. Raises a transient DriverError if the
        file cannot be opened."""
        if uid in self._held:
            return True
        path = self._locks.path(uid)
        for _ in range(_TAKE_TRIES):
            try:
                fd = open_lock_file(path)
            except OSError as err:
                raise transient(f"cannot open lock file {path}: {err.strerror or err}") from err
            if _try_flock(fd) and _same_file(fd, path):
                self._held[uid] = fd
                return True
            os.close(fd)  # held by another, or removed by its holder meanwhile
            time.sleep(0.001)
        return False

    def release(self) -> None:
        for uid, fd in self._held.items():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._locks.path(uid))  # before the close: nobody holds it then
            os.close(fd)
        self._held.clear()


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Is the locked descriptor still the file at `path` (not one its holder removed)?"""
    try:
        return os.lstat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
