"""The nvidia-cdi-hook executable that CDI specs name: the container runtime runs it on
the host, so the plugin copies the image's static binary into its own host directory
(the kubelet plugin data dir, mounted at the same path) and names that path, unless
--nvidia-cdi-hook-path names a hook installed on the host."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Final

from driver.fileio import DATA_DIR_MODE, temp_name

log = logging.getLogger(__name__)

HOOK_NAME: Final = "nvidia-cdi-hook"
HOOK_MODE: Final = 0o755


class CdiHookError(ValueError):
    """The hook cannot be installed or the configured path is unusable (one line)."""


def _is_current(dir_fd: int, data: bytes) -> bool:
    """Whether the destination is already a regular file (not a symlink) with mode 0755
    and exactly `data`."""
    try:
        st = os.stat(HOOK_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
        return False
    if stat.S_IMODE(st.st_mode) != HOOK_MODE:
        return False
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(HOOK_NAME, flags, dir_fd=dir_fd)
    except OSError:
        return False  # replaced since the stat: write it again
    with os.fdopen(fd, "rb") as f:
        return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read() == data


def _replace(dir_fd: int, data: bytes) -> None:
    """Write `data` to a fresh temp file in the directory, make it 0755 and durable,
    then rename it over the destination: whatever was there (a symlink included) is
    replaced, never written through, and a runtime executing the old file keeps it."""
    tmp = temp_name(Path(HOOK_NAME)).name
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, HOOK_MODE)  # not subject to the umask, unlike open's mode
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, HOOK_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def install_cdi_hook(source: Path, target_dir: Path) -> Path:
    """Copy the hook executable `source` to `target_dir/nvidia-cdi-hook` (mode 0755,
    atomically) and return that path. Nothing is written when the file there already
    has the same content and mode, so a restart never replaces it under a runtime.
    `target_dir` is created if missing; a symlink there is refused."""
    try:
        data = source.read_bytes()
    except OSError as err:
        raise CdiHookError(
            f"cannot read the {HOOK_NAME} executable {source}: {err.strerror or err}"
        ) from err
    target = target_dir / HOOK_NAME
    try:
        target_dir.mkdir(parents=True, exist_ok=True, mode=DATA_DIR_MODE)
        dir_fd = os.open(target_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if target_dir.is_symlink():
            raise CdiHookError(
                f"{target_dir} is a symbolic link; refusing to install {HOOK_NAME} into it"
            ) from err
        raise CdiHookError(
            f"cannot install {HOOK_NAME} into {target_dir}: {err.strerror or err}"
        ) from err
    try:
        if _is_current(dir_fd, data):
            log.info("%s is up to date", target)
            return target
        _replace(dir_fd, data)
    except OSError as err:
        raise CdiHookError(
            f"cannot install {HOOK_NAME} at {target}: {err.strerror or err}"
        ) from err
    finally:
        os.close(dir_fd)
    log.info("installed %s (%d bytes) from %s", target, len(data), source)
    return target


def cdi_hook_path(configured: str, target_dir: Path) -> str:
    """The host path of the hook that CDI specs name: `configured`
    (--nvidia-cdi-hook-path, a hook installed on the host; nothing is copied) or, if
    empty, where `install_cdi_hook` puts the image's copy in `target_dir`."""
    if configured:
        if not os.path.isabs(configured):
            raise CdiHookError(
                f"--nvidia-cdi-hook-path={configured!r} must be an absolute path on the host"
            )
        return configured
    return str(target_dir / HOOK_NAME)
