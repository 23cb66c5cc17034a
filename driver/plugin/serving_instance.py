"""The plugin instances of one node: which one serves it, and which one leaves last.

During a rolling update two instances share the data directory.

Serving (`Succession`): one instance at a time publishes the node's ResourceSlices,
prepares claims and answers the status socket; another yields. The rule (the live
place in `<data dir>/succession/` with the highest number serves; a place is taken at
a lone start and at each registration by the kubelet) and its cases are in
docs/rolling-updates.md. A place file is locked (flock) for as long as the process
runs, so a crash frees it. A new instance that never registers (a wrong registrar
directory) never takes the node from the one that serves it; when the newest one
exits, the next one serves again at once.

Leaving (`InstanceLock`). Each instance holds a shared `flock` on
`<data dir>/instances.lock` for its lifetime; at shutdown an instance that can upgrade
it to an exclusive lock is the last one, and only the last one removes node-wide
artefacts (the common CDI spec) that a successor would otherwise lose.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from driver.state.journal.locking import open_lock_file

log = logging.getLogger(__name__)

SUCCESSION_DIR = "succession"
CLAIM_LOCK = ".claim"
# How often the watch looks for a newer instance, or for the newer one's exit.
POLL_SECONDS = 0.5


class InstanceLock:
    def __init__(self, data_dir: Path) -> None:
        self._fd = open_lock_file(data_dir / "instances.lock")  # never through a symlink
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # waits while a last instance cleans up

    def release(self, on_last: Callable[[], None]) -> bool:
        """Releases the lock; when no other instance holds it, runs `on_last` first,
        still holding it exclusively, so a successor that starts meanwhile waits for
        the cleanup instead of having its fresh files removed. True when last."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            return False
        try:
            on_last()
        finally:
            os.close(self._fd)
        return True


@dataclass(frozen=True)
class Place:
    number: int
    holder: str  # "<host name, the pod's name in a pod> pid <pid>"

    def __str__(self) -> str:
        return f"{self.holder} (place {self.number})"


def default_holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


class Succession:
    """This instance's place among the node's instances (see the module docstring)."""

    def __init__(self, data_dir: Path, holder: str | None = None) -> None:
        self._dir = data_dir / SUCCESSION_DIR
        self._dir.mkdir(mode=0o700, exist_ok=True)
        self._holder = holder or default_holder()
        self._mutex = threading.Lock()
        self._place: Place | None = None
        # The place `_take` is moving this instance to: its file is there, locked by
        # this process, before `_place` names it; `newer()` (a prepare's question,
        # which does not wait for the registration) must not take it for another's.
        self._taking: int | None = None
        self._fd: int | None = None
        self._listeners: list[Callable[[bool], object]] = []
        self._was_serving = False
        self._notifying = threading.Lock()
        self._stopped = threading.Event()

    # -- what the rest of the plugin asks -------------------------------------------------

    @property
    def place(self) -> Place | None:
        return self._place

    def newer(self) -> Place | None:
        """The live place that outranks this instance's (any live place while this
        instance holds none), or None while this instance serves. While it serves, one
        directory listing: no place file above its own is opened."""
        mine = self._place
        for number in sorted(self._numbers(), reverse=True):
            if mine is not None and number <= mine.number:
                return None
            if number == self._taking:  # this instance's own, being taken (`_take`)
                continue
            holder = _live_holder(self._path(number))
            if holder is not None:
                return Place(number, holder)
        return None

    def serving(self) -> bool:
        return self._place is not None and self.newer() is None

    def on_change(self, listener: Callable[[bool], object]) -> None:
        """`listener(serving)` runs (on the watch thread, or the registering one)
        each time this instance starts or stops serving."""
        self._listeners.append(listener)

    # -- taking a place ---------------------------------------------------------------

    def start(self) -> bool:
        """Takes a place if no other instance holds one; True when this one serves."""
        with self._claiming():
            if self.newer() is None:
                self._take()
        self._notify()
        return self._place is not None

    def registered(self) -> None:
        """The kubelet registered this instance: it is the one the kubelet calls now."""
        with self._claiming():
            self._take()
        self._notify()

    def watch(self) -> None:
        """Notices a newer instance (this one yields) and its exit (this one serves
        again) within `POLL_SECONDS`."""
        threading.Thread(target=self._watch, name="succession", daemon=True).start()

    def stop(self) -> None:
        """Stops the watch and gives the place up (the process's exit would too)."""
        self._stopped.set()
        with self._mutex:
            if self._fd is not None and self._place is not None:
                self._path(self._place.number).unlink(missing_ok=True)
                os.close(self._fd)
            self._fd, self._place = None, None

    # -- internals --------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_SECONDS):
            try:
                if self._place is None and self.newer() is None:
                    self.start()  # the instance this one waited behind is gone
                self._notify()
            except Exception as err:  # a data directory gone bad: keep the last answer
                log.error("checking for other plugin instances: %s", err)

    def _notify(self) -> None:
        with self._notifying:  # listeners see the changes in the order they happened
            with self._mutex:
                serving = self.serving()
                if serving == self._was_serving:
                    return
                self._was_serving = serving
                newer = None if serving else self.newer()
            if serving:
                log.info("serving the node as %s", self._place)
            else:
                log.warning(
                    "%s serves the node now: this instance stopped publishing and refuses "
                    "prepares (the kubelet calls the newest instance)",
                    newer,
                )
            for listener in self._listeners:
                listener(serving)

    @contextlib.contextmanager
    def _claiming(self) -> Iterator[None]:
        fd = open_lock_file(self._dir / CLAIM_LOCK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with self._mutex:
                yield
        finally:
            os.close(fd)

    def _take(self) -> None:
        """A place above every other, its file locked before it appears (a scan never
        sees it free). Under the claim lock, which also guards removing dead places."""
        number = 1
        for other in self._numbers():
            path = self._path(other)
            fd = _open_place(path)
            if fd is None:
                continue  # not ours: never counted, never removed
            os.close(fd)
            number = max(number, other + 1)
            if (self._place is None or other != self._place.number) and _live_holder(path) is None:
                path.unlink(missing_ok=True)
        self._taking = number
        temp = self._dir / f".{number}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, self._holder.encode())
            os.rename(temp, self._path(number))
        except BaseException:
            temp.unlink(missing_ok=True)
            os.close(fd)
            raise
        if self._fd is not None and self._place is not None:
            self._path(self._place.number).unlink(missing_ok=True)
            os.close(self._fd)
        self._fd, self._place = fd, Place(number, self._holder)

    def _path(self, number: int) -> Path:
        return self._dir / f"{number:012d}"

    def _numbers(self) -> list[int]:
        return [int(entry) for entry in os.listdir(self._dir) if entry.isdigit()]


HOLDER_MAX = 256


def _open_place(path: Path) -> int | None:
    """A descriptor of the place file at `path`; None when it is gone or is not a
    regular file (never through a symlink, never blocking on a FIFO planted there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ELOOP):
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _live_holder(path: Path) -> str | None:
    """The holder named in the place file at `path` while a live instance holds it
    (locked), else None."""
    fd = _open_place(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return os.read(fd, HOLDER_MAX).decode(errors="replace")
        raise
    finally:
        os.close(fd)
    return None
