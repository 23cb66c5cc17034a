"""The read-back of an MPS daemon's pinned memory limit (driver/state/mps/daemons.py,
`configure_limits`): every form in which `get_default_device_pinned_mem_limit` may
answer is compared in bytes with what `set_default_device_pinned_mem_limit` was told
(whole MiB), so a partition of an odd size (a quarter of an H100's 81559 MiB: 20389
MiB) is taken whichever way the daemon prints it, and a limit it does not hold is
refused."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from driver.errors import DriverError
from driver.nvml.mps import DaemonDirs, DaemonId
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import configure_limits, pinned_limit_range

MIB = 1 << 20
ODD_MIB = 20389  # 81559 MiB // 4


class Daemon:
    """`MpsOps` whose control pipe answers the memory query with `answer`."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.told: list[str] = []

    def start(
        self, dirs: DaemonDirs, gpu_uuids: Sequence[str], *, multi_user: bool = False
    ) -> DaemonId:
        raise AssertionError("not started here")

    def running(self, dirs: DaemonDirs) -> DaemonId | None:
        return None

    def command(self, dirs: DaemonDirs, line: str) -> str:
        self.told.append(line)
        if line.startswith("get_default_device_pinned_mem_limit"):
            return self.answer
        return ""

    def stop(self, dirs: DaemonDirs, daemon: DaemonId | None) -> None:
        pass


def _configure(answer: str, limit_bytes: int) -> Daemon:
    daemon = Daemon(answer)
    record = MpsRecord("GPU-0", "claim-gpu-0", None, limit_bytes)
    configure_limits(daemon, DaemonDirs(Path("/p"), Path("/l")), record)
    return daemon


@pytest.mark.parametrize(
    "answer",
    [
        "20389M",  # the form it is told
        "20389M\n",
        "20389 M",
        "20389MB",
        "20389 MiB",
        "20878336K",  # the same in KiB
        "21379416064",  # in bytes
        "21379416064B",
        "19.91G",  # GiB with two decimals: 20389/1024 = 19.9111...
        "19.9G",  # one decimal: 20377.6 MiB, within half a digit
        "19.911G",
        "19.91 GiB",
        "Device 0 default pinned memory limit: 19.91 GiB",
    ],
)
def test_an_odd_limit_reads_back_in_any_form_the_daemon_prints(answer: str) -> None:
    daemon = _configure(answer, ODD_MIB * MIB)
    assert daemon.told[0] == f"set_default_device_pinned_mem_limit 0 {ODD_MIB}M"


@pytest.mark.parametrize(
    ("answer", "limit_mib"),
    [("8G", 8192), ("8192M", 8192), ("8.00G", 8192), ("2048M", 2048), ("1G", 1024)],
)
def test_whole_gib_limits_read_back_as_before(answer: str, limit_mib: int) -> None:
    _configure(answer, limit_mib * MIB)


def test_a_limit_of_bytes_beyond_whole_mib_is_compared_as_told() -> None:
    """The daemon is told whole MiB (rounded down): that is what it must hold."""
    daemon = _configure("20389M", ODD_MIB * MIB + 4096)
    assert daemon.told[0] == f"set_default_device_pinned_mem_limit 0 {ODD_MIB}M"


@pytest.mark.parametrize(
    "answer",
    [
        "20388M",  # a MiB short
        "20390M",
        "20G",  # a whole unit is exact: 20480 MiB is not 20389
        "19G",
        "19.92G",  # 20397.3 MiB down to 20392.2: above
        "19.90G",  # 20377.6 MiB up to 20387.8: below
        "21379416063",  # a byte short
        "0",
        "",
        "none",
        "invalid device 0",
        "20389X",
        "-20389M",
    ],
)
def test_a_limit_the_daemon_does_not_hold_is_refused(answer: str) -> None:
    with pytest.raises(DriverError, match="did not take pinned memory limit 20389M"):
        _configure(answer, ODD_MIB * MIB)


def test_the_range_of_a_rounded_answer() -> None:
    # 19.91 GiB is 21378199715.84 bytes; a last digit (0.01 GiB) is 10737418.24 bytes.
    assert pinned_limit_range("19.91G") == (21372831007, 21388937134)
    assert pinned_limit_range("20389M") == (ODD_MIB * MIB, ODD_MIB * MIB)
    assert pinned_limit_range("1.5K") == (1485, 1638)  # 1536 - 51.2 .. below 1536 + 102.4
    assert pinned_limit_range("12 parsecs") is None
