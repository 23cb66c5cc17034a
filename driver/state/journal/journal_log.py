"""The prepare journal's log, `<data dir>/checkpoint.log` (docs/state.md, "Durability").

One line per journal store since the snapshot (`checkpoint.json`) was last written,
holding every claim the store changed::

    {"checksum":"sha256:<hex>","delete":["<uid>"...],"set":{"<uid>": <entry>...}}\\n

`set` holds each changed claim's whole entry (as the snapshot stores it), `delete` the
claims whose entry went; the checksum is over the canonical JSON of the record
without it, so a store is applied whole or not at all. Replaying a record twice gives
the same entries as once: replaying the log over a snapshot that already contains it
changes nothing.

A store is one `write()` of its line (O_APPEND) and one `fdatasync`. A power loss
during the append can leave only the last line torn: cut short, or with zeros where
the lost blocks were. It was never acknowledged, so `scan` ignores a last line without
its newline or that is not JSON, and the next append cuts it off first. Any other bad
line is corruption (`CheckpointCorruptError` naming the line): a line that parses but
fails its checksum (bit rot; a torn append does not parse), or a bad line before the
last, since a torn append is always the last: the journal never appends after an
append it has not synced (`Checkpoint.store`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from driver.fileio import open_nofollow
from driver.observability import metrics
from driver.state.journal.journal_entries import (
    CHECKSUM_PREFIX,
    CheckpointCorruptError,
    ClaimEntry,
    canonical,
    checksum,
)

LOG_FILE: Final = "checkpoint.log"
_RECORD_KEYS: Final = frozenset({"delete", "set"})


@dataclass(frozen=True)
class LogRecord:
    """One store's changes: whole entries to set, claims whose entry goes."""

    line: int  # 1-based, for errors
    changed: Mapping[str, Any]  # uid -> the entry's stored JSON
    deleted: tuple[str, ...]


@dataclass(frozen=True)
class LogScan:
    """The whole records of a log, and where a torn tail after them begins."""

    records: tuple[LogRecord, ...]
    valid_size: int  # bytes up to the end of the last whole record
    size: int  # bytes read

    @property
    def torn_bytes(self) -> int:
        return self.size - self.valid_size


def encode_record(changed: Mapping[str, Any], deleted: Iterable[str]) -> bytes:
    """The line that records one store."""
    body = canonical({"delete": sorted(deleted), "set": changed})
    digest = CHECKSUM_PREFIX + hashlib.sha256(body).hexdigest()  # = checksum(the body)
    # Sorted keys put "checksum" first: prefix it to the body already encoded.
    return b'{"checksum":"' + digest.encode() + b'",' + body[1:] + b"\n"


def scan(data: bytes, path: Path) -> LogScan:
    """The records of a log's content; raises CheckpointCorruptError for a bad line
    that is not a torn last line (see the module doc)."""
    records: list[LogRecord] = []
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            break  # the last line, without its newline: torn
        line = len(records) + 1
        doc = _parsed(data[start:end])
        if doc is None:
            if end + 1 == len(data):
                break  # the last line, garbled: torn
            raise CheckpointCorruptError(path, f"line {line}: not a JSON object")
        try:
            records.append(_record(doc, line))
        except ValueError as err:
            raise CheckpointCorruptError(path, f"line {line}: {err}") from err
        start = end + 1
    return LogScan(tuple(records), start, len(data))


def _parsed(raw: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _record(doc: dict[str, Any], line: int) -> LogRecord:
    stored = doc.pop("checksum", None)
    actual = checksum(doc)
    if stored != actual:
        raise ValueError(f"checksum mismatch: stored {stored!r}, computed {actual}")
    changed, deleted = doc.get("set"), doc.get("delete")
    unknown = set(doc) - _RECORD_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (written by a newer driver?)")
    if not isinstance(changed, dict):
        raise ValueError("set must be an object")
    if not isinstance(deleted, list) or not all(isinstance(u, str) for u in deleted):
        raise ValueError("delete must be a list of claim uids")
    return LogRecord(line, changed, tuple(deleted))


def replay(entries: dict[str, ClaimEntry], records: Iterable[LogRecord], path: Path) -> None:
    """Apply `records` in order to `entries`."""
    for record in records:
        for uid, raw in record.changed.items():
            try:
                entries[uid] = ClaimEntry.from_json(raw)
            except ValueError as err:
                raise CheckpointCorruptError(
                    path, f"line {record.line}: entry {uid}: {err}"
                ) from err
        for uid in record.deleted:
            entries.pop(uid, None)


def open_log(path: Path, *, create: bool = False) -> int:
    """The log opened for appending (never through a symlink); FileNotFoundError if it
    does not exist and not `create`."""
    flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
    return open_nofollow(path, flags)


def append(fd: int, record: bytes, *, keep: int, sync: bool, reserve: int = 0) -> None:
    """Append `record` to the log open at `fd`, after cutting it to its first `keep`
    bytes (a torn tail; the cut is then synced with the record, whatever `sync`
    says). On error the log is cut back to `keep` bytes, as far as it can be.

    `reserve`: bytes the file system must have free beyond the record, or ENOSPC
    before anything is written. An append can fit in the log's last block on a full
    disk; the record that would roll it back might then not."""
    if reserve:
        st = os.fstatvfs(fd)
        if st.f_bavail * st.f_frsize < len(record) + reserve:
            raise OSError(
                errno.ENOSPC,
                f"{os.strerror(errno.ENOSPC)} (a journal record that prepares claims "
                f"keeps {reserve // 1024} KiB free for the record that rolls them back "
                "if the prepare fails; unprepares need no such room)",
            )
    torn = os.fstat(fd).st_size > keep
    if torn:
        os.ftruncate(fd, keep)
    try:
        view = memoryview(record)
        while view:
            view = view[os.write(fd, view) :]
        if sync or torn:
            os.fdatasync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, keep)
        raise
    metrics.STATE_FILE_WRITES.inc()


def empty(fd: int) -> None:
    """Cut the log open at `fd` to nothing, durably."""
    os.ftruncate(fd, 0)
    os.fsync(fd)
