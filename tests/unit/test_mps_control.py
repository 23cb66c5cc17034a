"""driver/nvml/mps.py over the mock driver root's nvidia-cuda-mps-control: the daemon
outlives the command that started it, answers through its control pipe, refuses what
the real one refuses, and `quit` ends it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.errors import DriverError
from driver.nvml.mock.mps_control import install_mps_control
from driver.nvml.mps import DaemonDirs, DaemonId, MpsControl, is_running


@pytest.fixture
def control(tmp_path: Path) -> MpsControl:
    install_mps_control(tmp_path / "root")
    return MpsControl(tmp_path / "root")


@pytest.fixture
def dirs(tmp_path: Path, control: MpsControl) -> Iterator[DaemonDirs]:
    dirs = DaemonDirs(tmp_path / "mps" / "pipe", tmp_path / "mps" / "log")
    yield dirs
    daemon = control.running(dirs)
    if daemon is not None:  # a failed test must not leave a daemon behind
        os.kill(daemon.pid, signal.SIGKILL)


def test_binary_is_found_only_where_installed(tmp_path: Path, control: MpsControl) -> None:
    assert control.available()
    assert not MpsControl(tmp_path / "empty").available()
    with pytest.raises(DriverError, match="no executable nvidia-cuda-mps-control under"):
        MpsControl(tmp_path / "empty").start(DaemonDirs(tmp_path / "p", tmp_path / "l"), ["GPU-x"])


def test_daemon_runs_in_its_own_session_and_takes_limits(
    control: MpsControl, dirs: DaemonDirs
) -> None:
    daemon = control.start(dirs, ["GPU-a"])
    assert is_running(daemon)
    assert daemon.pid != os.getpid() and os.getsid(daemon.pid) != os.getsid(0)
    assert control.running(dirs) == daemon
    assert control.command(dirs, "set_default_active_thread_percentage 25") == "25.0"
    assert control.command(dirs, "get_default_active_thread_percentage") == "25.0"
    assert control.command(dirs, "set_default_device_pinned_mem_limit 0 2048M") == "2048M"
    assert control.command(dirs, "get_default_device_pinned_mem_limit 0") == "2048M"
    # Only the devices of its CUDA_VISIBLE_DEVICES, only valid values.
    assert control.command(dirs, "set_default_device_pinned_mem_limit 1 2048M") == (
        "Invalid device 1"
    )
    assert control.command(dirs, "set_default_active_thread_percentage 0") == (
        "Invalid percentage 0"
    )
    log = (dirs.log / "control.log").read_text()
    assert "CUDA_VISIBLE_DEVICES=GPU-a" in log
    assert "set_default_device_pinned_mem_limit 0 2048M" in log


def test_second_daemon_on_one_pipe_directory_is_refused(
    control: MpsControl, dirs: DaemonDirs
) -> None:
    first = control.start(dirs, ["GPU-a"])
    with pytest.raises(DriverError, match="An instance of this daemon is already running"):
        control.start(dirs, ["GPU-a"])
    assert control.running(dirs) == first


def test_quit_stops_it_and_a_stopped_daemon_counts_as_stopped(
    control: MpsControl, dirs: DaemonDirs
) -> None:
    daemon = control.start(dirs, ["GPU-a"])
    control.stop(dirs, daemon)
    assert not is_running(daemon)
    assert control.running(dirs) is None
    control.stop(dirs, daemon)  # nothing left to stop
    with pytest.raises(DriverError, match="Cannot find MPS control daemon process"):
        control.command(dirs, "get_server_list")


def test_a_reused_pid_is_not_the_daemon() -> None:
    me = DaemonId(os.getpid(), 0)
    assert not is_running(me)
