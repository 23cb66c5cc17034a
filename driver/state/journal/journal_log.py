"""The prepare journal's log, `<data dir>/checkpoint.log`: one line per journal store
since the snapshot was last written (format and rules: docs/state.md, "The log")::

    {"checksum":"sha256:<hex>","delete":["<uid>"...],"set":{"<uid>": <entry>...}}\\n

A store is one record, so it applies whole or not at all; replaying a record twice
gives the same entries as once, so replaying the log over a snapshot that already
contains it changes nothing. A power loss during an append can tear only the last
line (cut short, or zeros where lost blocks were): it was never acknowledged, so
`scan` ignores it and the next append cuts it off. Any other bad line is corruption:
a line that parses but fails its checksum (bit rot; a torn append does not parse),
or a bad line before the last, since the journal never appends after an append it
has not synced (`Checkpoint.store`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
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
    torn_bytes: int  # bytes after it


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
        try:
            doc = json.loads(data[start:end])
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict):
            if end + 1 == len(data):
                break  # the last line, garbled: torn
            raise CheckpointCorruptError(path, f"line {line}: not a JSON object")
        try:
            records.append(_record(doc, line))
        except ValueError as err:
            raise CheckpointCorruptError(path, f"line {line}: {err}") from err
        start = end + 1
    return LogScan(tuple(records), start, len(data) - start)


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


@contextlib.contextmanager
def open_log(path: Path, *, create: bool = False) -> Iterator[int]:
    """The log opened for appending (never through a symlink) for the block;
    FileNotFoundError if it does not exist and not `create`."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0))
    try:
        yield fd
    finally:
        os.close(fd)


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
