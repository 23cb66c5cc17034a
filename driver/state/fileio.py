"""Crash-safe file primitives shared by the CDI writer and the checkpoint journal."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Final

from driver.observability import metrics
from driver.state.failpoints import failpoint

TEMP_MARKER: Final = ".tmp-"


def temp_name(target: Path) -> Path:
    """A fresh temp path next to `target`: hidden and not ending in .json/.yaml, so
    the CDI registry never reads a half-written spec."""
    return target.with_name(f".{target.name}{TEMP_MARKER}{secrets.token_hex(6)}")


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    target: Path,
    data: bytes,
    *,
    mode: int = 0o600,
    before_rename: str | None = None,
    sync_dir: bool = True,
) -> None:
    """Replace `target` with `data` so that a crash leaves either the old or the new
    content: temp file in the same directory, fsync, rename, fsync the directory.

    `before_rename` names a failpoint passed after the temp file is durable and
    before the rename. On error the temp file is removed and OSError propagates.

    `sync_dir=False` skips the directory fsync: the content is durable but the rename
    is not until the caller runs `fsync_dir(target.parent)`, once for a whole batch of
    writes to that directory, before anything that relies on the new content.
    """
    tmp = temp_name(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        if before_rename is not None:
            failpoint(before_rename)
        os.replace(tmp, target)
        metrics.STATE_FILE_WRITES.inc()
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(target.parent)


def remove_durably(target: Path, *, sync_dir: bool = True) -> bool:
    """Unlink `target` and fsync its directory. Returns False if it did not exist
    (then nothing is synced). `sync_dir=False`: as for `atomic_write`, the caller
    fsyncs the directory once after a batch of removals."""
    try:
        os.unlink(target)
    except FileNotFoundError:
        return False
    metrics.STATE_FILE_WRITES.inc()
    if sync_dir:
        fsync_dir(target.parent)
    return True


def sweep_temp_files(directory: Path, stem_prefix: str) -> list[Path]:
    """Remove temp files left by a crash whose target name starts with `stem_prefix`.

    Only call this while holding the serialize lock: a live writer in another plugin
    instance also holds it, so every temp file seen then is an orphan.
    """
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    prefix = f".{stem_prefix}"
    for name in names:
        if name.startswith(prefix) and TEMP_MARKER in name:
            path = directory / name
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
    return removed
