"""Installing nvidia-cdi-hook into the plugin's host directory (driver/cdi/hook.py):
atomic, mode 0755, never through a symlink, not rewritten when unchanged."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from driver.cdi.hook import (
    HOOK_NAME,
    CdiHookError,
    cdi_hook_path,
    install_cdi_hook,
)

HOOK = b"\x7fELF static nvidia-cdi-hook v1\n" * 64


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "image" / HOOK_NAME
    path.parent.mkdir()
    path.write_bytes(HOOK)
    return path


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    path = tmp_path / "plugins" / "gpu.example.com"
    path.mkdir(parents=True)
    return path


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != HOOK_NAME)


def test_copies_the_hook_executable(source: Path, target_dir: Path) -> None:
    installed = install_cdi_hook(source, target_dir)
    assert installed == target_dir / HOOK_NAME
    assert installed.read_bytes() == HOOK
    st = os.lstat(installed)
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o755
    assert leftovers(target_dir) == []  # no temp file left behind


def test_mode_is_0755_whatever_the_umask(source: Path, target_dir: Path) -> None:
    old = os.umask(0o077)
    try:
        installed = install_cdi_hook(source, target_dir)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(installed).st_mode) == 0o755


def test_creates_a_missing_target_dir(source: Path, tmp_path: Path) -> None:
    installed = install_cdi_hook(source, tmp_path / "new" / "dir")
    assert installed.read_bytes() == HOOK


def test_same_content_is_not_rewritten(source: Path, target_dir: Path) -> None:
    installed = install_cdi_hook(source, target_dir)
    past = 1_000_000_000
    os.utime(installed, (past, past))
    before = os.lstat(installed)
    assert install_cdi_hook(source, target_dir) == installed
    after = os.lstat(installed)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_content_replaces_the_file(source: Path, target_dir: Path) -> None:
    installed = install_cdi_hook(source, target_dir)
    old_inode = os.lstat(installed).st_ino
    source.write_bytes(HOOK + b"v2")
    install_cdi_hook(source, target_dir)
    assert installed.read_bytes() == HOOK + b"v2"
    assert os.lstat(installed).st_ino != old_inode  # renamed over, not written in place
    assert stat.S_IMODE(os.lstat(installed).st_mode) == 0o755
    # Same size, different bytes: compared by content, not only by size.
    source.write_bytes(HOOK + b"v3")
    install_cdi_hook(source, target_dir)
    assert installed.read_bytes() == HOOK + b"v3"


def test_wrong_mode_is_rewritten(source: Path, target_dir: Path) -> None:
    installed = install_cdi_hook(source, target_dir)
    os.chmod(installed, 0o644)
    install_cdi_hook(source, target_dir)
    assert stat.S_IMODE(os.lstat(installed).st_mode) == 0o755


@pytest.mark.parametrize("same_content", [False, True], ids=["other", "same"])
def test_symlink_at_destination_is_replaced_not_followed(
    source: Path, target_dir: Path, tmp_path: Path, same_content: bool
) -> None:
    elsewhere = tmp_path / "elsewhere"
    original = HOOK if same_content else b"do not touch"
    elsewhere.write_bytes(original)
    os.chmod(elsewhere, 0o644)
    (target_dir / HOOK_NAME).symlink_to(elsewhere)
    installed = install_cdi_hook(source, target_dir)
    assert not installed.is_symlink()
    assert stat.S_ISREG(os.lstat(installed).st_mode)
    assert installed.read_bytes() == HOOK
    assert elsewhere.read_bytes() == original
    assert stat.S_IMODE(os.lstat(elsewhere).st_mode) == 0o644


def test_fifo_at_destination_is_replaced(source: Path, target_dir: Path) -> None:
    os.mkfifo(target_dir / HOOK_NAME)
    installed = install_cdi_hook(source, target_dir)
    assert stat.S_ISREG(os.lstat(installed).st_mode)
    assert installed.read_bytes() == HOOK


def test_directory_at_destination_fails_naming_it(source: Path, target_dir: Path) -> None:
    (target_dir / HOOK_NAME).mkdir()
    with pytest.raises(CdiHookError, match=str(target_dir / HOOK_NAME)):
        install_cdi_hook(source, target_dir)
    assert leftovers(target_dir) == []


@pytest.mark.parametrize("dangling", [False, True], ids=["to-dir", "dangling"])
def test_symlinked_target_dir_is_refused(
    source: Path, tmp_path: Path, target_dir: Path, dangling: bool
) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing" if dangling else target_dir)
    with pytest.raises(CdiHookError) as info:
        install_cdi_hook(source, link)
    message = str(info.value)
    assert f"{link} is a symbolic link" in message and "\n" not in message
    assert list(target_dir.iterdir()) == []
    assert not (tmp_path / "missing").exists()


def test_missing_source_fails_naming_it(tmp_path: Path, target_dir: Path) -> None:
    missing = tmp_path / "nope" / HOOK_NAME
    with pytest.raises(CdiHookError) as info:
        install_cdi_hook(missing, target_dir)
    message = str(info.value)
    assert str(missing) in message and "No such file" in message and "\n" not in message
    assert list(target_dir.iterdir()) == []


def test_configured_path_is_returned_and_nothing_copied(source: Path, target_dir: Path) -> None:
    configured = "/usr/bin/nvidia-cdi-hook"
    assert cdi_hook_path(configured, target_dir) == configured
    assert list(target_dir.iterdir()) == []


@pytest.mark.parametrize("configured", ["usr/bin/nvidia-cdi-hook", "./nvidia-cdi-hook"])
def test_relative_configured_path_is_refused(
    configured: str, source: Path, target_dir: Path
) -> None:
    with pytest.raises(CdiHookError, match="--nvidia-cdi-hook-path") as info:
        cdi_hook_path(configured, target_dir)
    assert configured in str(info.value)
    assert list(target_dir.iterdir()) == []


def test_empty_configured_path_names_where_the_copy_goes(source: Path, target_dir: Path) -> None:
    path = cdi_hook_path("", target_dir)
    assert path == str(install_cdi_hook(source, target_dir)) == str(target_dir / HOOK_NAME)
    assert Path(path).read_bytes() == HOOK


def test_error_is_a_value_error() -> None:
    assert issubclass(CdiHookError, ValueError)
