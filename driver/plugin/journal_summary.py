"""What the prepare journal holds, counted for /status and the prepared-claims metrics.

Read from the file, without the node lock: the plugin replaces the journal atomically,
so a read sees one whole version. The file is parsed again only when it changed
(inode, size, modification time), so a scrape every few seconds costs one `stat`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from driver.errors import DriverError
from driver.state.checkpoint import Checkpoint, CheckpointCorruptError, ClaimState


@dataclass(frozen=True)
class JournalSummary:
    status: str  # ok | absent | corrupt | unreadable
    problem: str | None = None
    # None while the file cannot be read: nothing is known about the claims then.
    prepared_claims: int | None = 0  # PrepareCompleted
    preparing_claims: int | None = 0  # PrepareStarted (in progress, or left by a crash)
    prepared_devices: int | None = 0  # devices of the prepared claims

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "problem": self.problem,
            "preparedClaims": self.prepared_claims,
            "preparingClaims": self.preparing_claims,
            "preparedDevices": self.prepared_devices,
        }


def summarise(checkpoint: Checkpoint) -> JournalSummary:
    try:
        entries = checkpoint.load()
    except CheckpointCorruptError as err:
        return JournalSummary("corrupt", str(err), None, None, None)
    except DriverError as err:  # an I/O error
        return JournalSummary("unreadable", str(err), None, None, None)
    if not entries and not checkpoint.path.exists():
        return JournalSummary("absent")
    prepared = [e for e in entries.values() if e.state is ClaimState.PREPARE_COMPLETED]
    return JournalSummary(
        "ok",
        prepared_claims=len(prepared),
        preparing_claims=len(entries) - len(prepared),
        prepared_devices=sum(len(e.devices) for e in prepared),
    )


class JournalReader:
    """`summary()` of one journal file, re-read only when the file changed."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None
        self._summary: JournalSummary | None = None

    def summary(self) -> JournalSummary:
        try:
            st = os.stat(self.checkpoint.path, follow_symlinks=False)
            key: tuple[int, int, int] | None = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            key = None  # absent or unreadable: summarise says which
        with self._lock:
            if self._summary is None or key is None or key != self._key:
                self._summary = summarise(self.checkpoint)
                self._key = key
            return self._summary
