"""Knowing whether this is the last plugin instance on the node.

During a rolling update two instances share the data directory. Each holds a shared
`flock` on `<data dir>/instances.lock` for its lifetime; at shutdown an instance that
can upgrade it to an exclusive lock is the last one, and only the last one removes
node-wide artefacts (the common CDI spec) that a successor would otherwise lose.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class InstanceLock:
    def __init__(self, data_dir: Path) -> None:
        self._fd = os.open(data_dir / "instances.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def release(self) -> bool:
        """Releases the lock; True when no other instance holds it."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            last = True
        except BlockingIOError:
            last = False
        os.close(self._fd)
        return last
