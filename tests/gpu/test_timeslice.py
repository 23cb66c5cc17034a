"""The time-slice interval set with the host's nvidia-smi, as the driver runs it for a
claim's TimeSlicing config (driver/nvml/smi_timeslice.py): the same argv, the driver root's
binary and NVML library. The GPU is left at `Default`, the interval it had."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from driver.errors import DriverError
from driver.nvml.discovered import GpuInfo
from driver.nvml.smi_timeslice import NvidiaSmiTimeSlice
from tests.nvml_probe import UNKNOWN_GPU_UUID


def _slicer() -> NvidiaSmiTimeSlice:
    return NvidiaSmiTimeSlice(Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/"))


def _listed_interval(slicer: NvidiaSmiTimeSlice, uuid: str) -> str:
    """The interval `nvidia-smi compute-policy -l` lists for the GPU (its table's
    `Timeslice` row)."""
    argv = [str(slicer.binary()), "compute-policy", "-l", "-i", uuid]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    match = re.search(r"\bTimeslice\s+(\w+)", out)
    assert match, out
    return match.group(1)


def test_each_interval_is_set_as_listed_and_default_restored(whole_gpu: GpuInfo) -> None:
    slicer = _slicer()
    print("nvidia-smi:", slicer.binary())
    try:
        for interval in ("Short", "Medium", "Long"):
            slicer.set(whole_gpu.uuid, interval)
            assert _listed_interval(slicer, whole_gpu.uuid) == interval
    finally:
        slicer.set(whole_gpu.uuid, "Default")
    assert _listed_interval(slicer, whole_gpu.uuid) == "Default"


def test_an_unknown_gpu_fails_with_nvidia_smis_own_line(whole_gpu: GpuInfo) -> None:
    with pytest.raises(DriverError) as err:
        _slicer().set(UNKNOWN_GPU_UUID, "Long")
    print(err.value)
    assert UNKNOWN_GPU_UUID in str(err.value)
    assert "exited with status" in str(err.value)
