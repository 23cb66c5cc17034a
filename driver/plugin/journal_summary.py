"""What the prepare journal holds, counted for /status and the prepared-claims metrics.

Read from the files, without the node lock: the plugin replaces the snapshot
atomically and appends whole records to the log (a record still being appended is
ignored), so a read sees one whole version. The files are parsed again only when one
changed (inode, size, modification time), so a scrape every few seconds costs two
`stat`s.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.errors import DriverError
from driver.state.journal.checkpoint import Checkpoint, CheckpointCorruptError, ClaimState


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


FileKey = tuple[int, int, int] | None  # (inode, size, mtime ns); None: absent or unreadable


def _file_key(path: Path) -> FileKey:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None  # summarise says which
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class JournalReader:
    """`summary()` of one journal (snapshot and log), re-read only when a file changed."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self._lock = threading.Lock()
        self._key: tuple[FileKey, FileKey] | None = None
        self._summary: JournalSummary | None = None

    def summary(self) -> JournalSummary:
        key = (_file_key(self.checkpoint.path), _file_key(self.checkpoint.log_path))
        with self._lock:
            if self._summary is None or key[0] is None or key != self._key:
                self._summary = summarise(self.checkpoint)
                self._key = key
            return self._summary
