"""Knowing whether this is the last plugin instance on the node.

During a rolling update two instances share the data directory. Each holds a shared
`flock` on `<data dir>/instances.lock` for its lifetime; at shutdown an instance that
can upgrade it to an exclusive lock is the last one, and only the last one removes
node-wide artefacts (the common CDI spec) that a successor would otherwise lose.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from driver.state.locking import open_lock_file


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
