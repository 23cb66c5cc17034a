"""A plugin process whose prepare of one MIG device is killed (SIGKILL) at a crash
point; the test that starts it then restarts the node and checks what recovery does
(tests/gpu/mig_scenarios.py).

    python -m tests.gpu.crash_child ROOT CLAIM_UID DEVICE CRASH_POINT MIG_STRATEGY

on the host's NVML. The crash points, in the order a prepare passes them:

- `prepare-before-mig-create`: the driver's failpoint; the intent is journaled,
  nothing created;
- `gpu-instance-created`: NVML created the GPU instance and the process dies as it
  asks for the compute instance (the driver has no failpoint inside the MIG
  manager's create, so NVML's compute-instance call is where the kill happens);
- `prepare-after-mig-create`: the driver's failpoint; the MIG device exists, the
  journal still holds the intent only.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from driver.devices.model import MigStrategy
from driver.failpoints import ENV_VAR, FAILPOINTS
from driver.nvml.backend import NvmlBackend
from driver.nvml.mig.mig_manager import MigManager
from tests.gpu.node import host_backend, open_node

GPU_INSTANCE_CREATED = "gpu-instance-created"
CRASH_POINTS = ("prepare-before-mig-create", GPU_INSTANCE_CREATED, "prepare-after-mig-create")


class KillAtComputeInstanceCreate:
    """The NVML module, except that asking for a compute instance kills the process:
    the GPU instance exists, its compute instance never will."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nvml, name)

    def nvmlGpuInstanceCreateComputeInstance(self, gpu_instance: Any, profile_id: int) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


def crash_prepare(
    backend: NvmlBackend,
    root: Path,
    uid: str,
    device: str,
    crash_point: str,
    strategy: MigStrategy,
) -> None:
    """Prepare `device` for claim `uid` on the node under `root` and die at
    `crash_point`; SystemExit if the prepare returns instead."""
    if crash_point not in CRASH_POINTS:
        raise ValueError(f"crash point {crash_point!r}: expected one of {', '.join(CRASH_POINTS)}")
    mig = None
    if crash_point == GPU_INSTANCE_CREATED:
        mig = MigManager(KillAtComputeInstanceCreate(backend.module))
    node = open_node(backend, root, strategy, mig=mig)
    if crash_point in FAILPOINTS:
        os.environ[ENV_VAR] = crash_point  # armed once start-up is done
    result = node.state.prepare([node.claims.add(uid, device)])[uid]
    raise SystemExit(f"prepare of {device} returned instead of dying at {crash_point}: {result}")


def main(argv: Sequence[str]) -> None:
    if len(argv) != 5:
        raise SystemExit(
            "usage: python -m tests.gpu.crash_child ROOT CLAIM_UID DEVICE CRASH_POINT MIG_STRATEGY"
        )
    root, uid, device, crash_point, strategy = argv
    crash_prepare(host_backend(), Path(root), uid, device, crash_point, MigStrategy(strategy))


if __name__ == "__main__":
    main(sys.argv[1:])
