"""The compute processes on a GPU as NVML lists them, and which of them use MPS.

nvml.h: `nvmlDeviceGetComputeRunningProcesses_v3` lists the processes with a compute
context on the device; `nvmlDeviceGetMPSComputeRunningProcesses_v3` "returns
information only about compute running processes (e.g. CUDA application which have
active context) utilizing MPS". pynvml's `nvmlDeviceGetComputeRunningProcesses` and
`nvmlDeviceGetMPSComputeRunningProcesses` call the `_v3` functions and return objects
with `pid`, `usedGpuMemory` (None where not available), `gpuInstanceId`,
`computeInstanceId`. An MPS server (`nvidia-cuda-mps-server`) owns a compute context of
its own and is listed among the compute processes (NVIDIA's MPS guide: it "will appear
as the active CUDA process"); its clients are in the MPS list (nvidia-smi shows a
process in both as type `M+C`). A process in the compute list that is neither in the
MPS list nor an MPS server has a CUDA context of its own: it runs outside MPS.

`nvmlSystemGetProcessName(pid)` names a process; NOT_FOUND where the caller cannot see
it (another PID namespace: the plugin needs the host's to name other pods' processes).

pids are those of the caller's PID namespace; `ProcessReader.read` never raises for
one GPU's answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final

from driver.nvml.calls import CountingModule, is_nvml_error, nvml_text
from driver.nvml.library import GpuHandles

log = logging.getLogger(__name__)

MPS_SERVER: Final = "nvidia-cuda-mps-server"


@dataclass(frozen=True)
class GpuProcess:
    """One process with a compute context on a GPU."""

    pid: int
    used_bytes: int | None  # None: NVML cannot tell
    mps_client: bool  # in nvmlDeviceGetMPSComputeRunningProcesses
    name: str | None  # nvmlSystemGetProcessName; None: not visible from here

    @property
    def mps_server(self) -> bool:
        return self.name is not None and PurePosixPath(self.name).name == MPS_SERVER

    @property
    def outside_mps(self) -> bool:
        """A CUDA context of its own that is neither an MPS server nor an MPS client.
        A process that cannot be named is not taken for one (it may be a server)."""
        return not self.mps_client and self.name is not None and not self.mps_server


@dataclass(frozen=True)
class GpuProcesses:
    """One GPU's listing: its processes, or why NVML did not list them."""

    gpu_uuid: str
    processes: tuple[GpuProcess, ...] = ()
    error: str = ""


class ProcessReader:
    """Lists the compute processes of GPUs through a counted pynvml-compatible module."""

    def __init__(self, nvml: CountingModule | Any, gpus: GpuHandles | None = None) -> None:
        self._nvml = nvml
        self._gpus = gpus or GpuHandles(nvml)

    def read(self, gpu_uuid: str) -> GpuProcesses:
        nvml = self._nvml
        [handle] = self._gpus.get(gpu_uuid)
        if handle is None:
            return GpuProcesses(gpu_uuid, error="NVML lists no such GPU (or it is lost)")
        try:
            compute = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
            mps = {int(p.pid) for p in nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)}
        except nvml.NVMLError as err:
            if is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                self._gpus.forget(gpu_uuid)
            return GpuProcesses(gpu_uuid, error=str(err))
        processes: dict[int, GpuProcess] = {}
        for info in compute:
            pid = int(info.pid)
            if pid not in processes:
                used = info.usedGpuMemory
                processes[pid] = GpuProcess(
                    pid, None if used is None else int(used), pid in mps, self._name(pid)
                )
        return GpuProcesses(gpu_uuid, tuple(processes.values()))

    def _name(self, pid: int) -> str | None:
        nvml = self._nvml
        try:
            return nvml_text(nvml.nvmlSystemGetProcessName(pid))
        except nvml.NVMLError as err:
            log.debug("NVML cannot name process %d: %s", pid, err)
            return None
