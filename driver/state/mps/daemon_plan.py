"""What a device's MPS daemon will be, decided at planning (pure; docs/mps.md): its
journal record (GPU, directory, limits) and the CDI edits that lead the device's
containers to it. The daemon itself is started at the apply stage
(driver/state/mps/claim_daemons.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from driver.cdi.claim_specs import CdiMount
from driver.config import GpuConfig
from driver.config.mps_limits import mps_memory_text
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import daemon_directory, daemon_dirs
from driver.state.mps.prepared_limits import MpsLimits, allotment, mps_limits
from driver.state.mps.shared import server_limits, shared_directory
from driver.state.request import PreparableDevice

CONTAINER_PIPE_DIRECTORY: Final = "/tmp/nvidia-mps"
CONTAINER_SHM_DIRECTORY: Final = "/dev/shm"


@dataclass(frozen=True)
class MpsSite:
    """Where this node's daemons keep their directories (what planning is told)."""

    root: Path
    private_shm: bool


@dataclass(frozen=True)
class MpsPlan:
    record: MpsRecord
    env: tuple[str, ...]
    mounts: tuple[CdiMount, ...]


def plan_mps(
    limits: MpsLimits | None,
    *,
    gpu_uuid: str,
    cdi_name: str,
    site: MpsSite | None,
    server: MpsLimits | None = None,
) -> MpsPlan | None:
    """The daemon of a device prepared with `limits` (driver/state/mps/prepared_limits.py), None
    for no daemon; `site` None only with no limits (a node without MPS). `server`: the
    limits of the GPU's shared server (a strict partition, driver/state/mps/shared.py),
    whose clients' env carries the claim's `limits`, which can only lower them."""
    if limits is None or site is None:
        return None
    daemon = server if server is not None else limits
    record = MpsRecord(
        gpu_uuid,
        shared_directory(gpu_uuid) if server is not None else daemon_directory(cdi_name),
        daemon.active_thread_percentage,
        daemon.pinned_memory_bytes,
        shared=server is not None,
    )
    env = [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIRECTORY}"]
    if limits.active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={limits.active_thread_percentage}")
    if limits.pinned_memory_bytes is not None:
        memory = mps_memory_text(limits.pinned_memory_bytes)
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={memory}")
    dirs = daemon_dirs(site.root, record)
    mounts = [CdiMount(str(dirs.pipe), CONTAINER_PIPE_DIRECTORY)]
    if site.private_shm:
        mounts.append(CdiMount(str(dirs.shm), CONTAINER_SHM_DIRECTORY))
    return MpsPlan(record, tuple(env), tuple(mounts))


def plan_device_mps(
    config: GpuConfig,
    device: PreparableDevice,
    devices: Mapping[str, PreparableDevice],
    consumed: Mapping[str, Any],
    cdi_name: str,
    site: MpsSite | None,
) -> MpsPlan | None:
    """The daemon of `device` as `config` and its allocation (`consumed`: a share's
    capacity) give it, None for none. `site` None: no daemon may limit the device
    here (a node without MPS, a MIG device, admin access), and an `MPS` config is
    refused (ConfigError)."""
    given = allotment(device, devices, consumed) if site is not None else None
    limits = mps_limits(config, given, device_name=device.name, gpu_uuid=device.gpu_uuid)
    return plan_mps(
        limits,
        gpu_uuid=device.gpu_uuid,
        cdi_name=cdi_name,
        site=site,
        server=server_limits(device, given),
    )
