"""What the MPS tests of the real-GPU tier need beside a GPU with MIG mode off, or why
they skip: the driver root's nvidia-cuda-mps-control and a compute mode that admits
MPS. The compute mode is only read (the driver never sets it); each test checks it is
unchanged at its end."""

from __future__ import annotations

import subprocess
from collections.abc import Collection
from pathlib import Path

import pytest

from driver.nvml.mps import find_binary

# One MPS server per GPU at most under Exclusive_Process; Default admits several.
ONE_SERVER = ("Default", "Exclusive_Process")
SEVERAL_SERVERS = ("Default",)


def compute_mode(uuid: str) -> str:
    argv = ["nvidia-smi", "-i", uuid, "--query-gpu=compute_mode", "--format=csv,noheader"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def require_mps(driver_root: Path, uuid: str, modes: Collection[str] = ONE_SERVER) -> str:
    """The GPU's compute mode; skips, saying why, without the driver root's
    nvidia-cuda-mps-control or in a compute mode outside `modes`."""
    if find_binary(driver_root) is None:
        pytest.skip(f"no nvidia-cuda-mps-control under the driver root {driver_root}")
    mode = compute_mode(uuid)
    if mode not in modes:
        pytest.skip(
            f"GPU {uuid} is in compute mode {mode}; this MPS test needs {' or '.join(modes)}"
        )
    return mode
