"""Crash-safe file primitives shared by the CDI writer, the checkpoint journal and the
health store: atomic writes, durable unlinks, temp-file sweeps, reads that never
follow a symlink."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Final

from driver.failpoints import failpoint
from driver.observability import metrics

TEMP_MARKER: Final = ".tmp-"
# The plugin's data directory (journal, lock file, health store): owner and group only.
DATA_DIR_MODE: Final = 0o750


def permission_denied(path: object) -> str:
    """One line for a file or directory of the plugin's that this user may not read
    (the operator CLI's permission errors), with what to do."""
    return (
        f"permission denied on {path}: run as root: in the plugin's pod (kubectl exec), or "
        'on the node in a root debug container (docs/day-2.md, "On the node")'
    )


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
    durable: bool = True,
) -> None:
    """Replace `target` with `data` so that a crash leaves either the old or the new
    content: temp file in the same directory, fsync, rename, fsync the directory.

    `before_rename` names a failpoint passed after the temp file is durable and
    before the rename. On error the temp file is removed and OSError propagates.

    `durable=False` fsyncs nothing: readers see the old or the new content (the
    rename), but a power loss may take either, or leave the new name with partial
    content. For files another durable record can rebuild (the claims' CDI specs,
    from the journal, at start).
    """
    tmp = temp_name(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
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
    if durable:
        fsync_dir(target.parent)


def remove_durably(target: Path, *, sync_dir: bool = True) -> bool:
    """Unlink `target` and fsync its directory. Returns False if it did not exist
    (then nothing is synced). `sync_dir=False`: no fsync (as `durable=False` for
    `atomic_write`)."""
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
    Only while holding the serialize lock: a live writer in another plugin instance
    also holds it, so every temp file seen then is an orphan."""
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


class UnsafeFileError(OSError):
    """A state file's path holds a symlink (errno ELOOP) or something other than a
    regular file (EINVAL): refused, never followed or opened for reading."""


def read_file_nofollow(path: Path) -> bytes:
    """The content of the regular file at `path`, opened with O_NOFOLLOW: a symlink
    at `path` itself is refused (`UnsafeFileError`, ELOOP), whatever it points to.
    O_NONBLOCK keeps a FIFO planted there from blocking the open; anything but a
    regular file is refused (`UnsafeFileError`, EINVAL). Raises FileNotFoundError if
    nothing is there. (Directories above `path` are resolved as usual: an operator
    may mount or link the CDI root or the data directory anywhere.)"""
    return read_regular_file(path)[0]


def read_regular_file(path: Path) -> tuple[bytes, os.stat_result]:
    """`read_file_nofollow`, with the file's status taken before it was read: a writer
    that changes the file during the read leaves a status that differs from the
    file's next one."""
    fd = open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        status = os.fstat(fd)
        return f.read(), status


def open_nofollow(path: Path, flags: int, mode: int = 0o600, *, use: str = "read") -> int:
    """`os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)` of a regular file; a symlink
    (ELOOP) or anything but a regular file (EINVAL; "refusing to <use> it") at `path`
    is refused (`UnsafeFileError`). Other OSErrors propagate."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafeFileError(
                errno.ELOOP, "is a symbolic link; refusing to follow it", str(path)
            ) from err
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeFileError(
            errno.EINVAL, f"is not a regular file; refusing to {use} it", str(path)
        )
    return fd
