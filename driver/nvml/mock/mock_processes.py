"""The mock NVML's compute processes: what `nvmlDeviceGetComputeRunningProcesses`,
`nvmlDeviceGetMPSComputeRunningProcesses` and `nvmlSystemGetProcessName` answer.

`ProcessFunctions` is mixed into `MockNvml`. No CUDA process ever runs on a mock GPU,
so its processes are started by hand (`start_process`; the plugin's mock control
action `process`, driver/nvml/mock/mock_control.py) and listed as NVML lists them:

- `compute`: a CUDA context of its own (a process outside MPS): in the compute list;
- `mps-client`: a client of an MPS server: in the MPS list and in the compute list
  (nvidia-smi's `M+C`). The first client on a GPU also starts that GPU's MPS server,
  as the control daemon starts one for its first client;
- `mps-server`: `nvidia-cuda-mps-server`, the MPS server's own context: in the
  compute list only.

A process that opens a CUDA context of its own (`compute`, or the server of a first
`mps-client`) is refused where the GPU's compute mode forbids it
(`DevicesUnavailable`, "all CUDA-capable devices are busy or unavailable": in
`EXCLUSIVE_PROCESS` while another process holds a context, in `PROHIBITED` always;
driver/nvml/mock/mock_compute_mode.py); a client of a running server is not. The
stand-in MPS control daemon starts no server: as NVIDIA's, its server comes with the
first client.

pids start above Linux's largest `pid_max` (2^22), so a mock process is never taken
for a live process of the node. With a driver root, a process started with a pod UID
gets `<driver root>/proc/<pid>/cgroup` naming a container cgroup of that pod (cgroup
v2, the systemd driver's names), where the plugin reads it through the backend's
`kernel_root`, as it reads the host's `/proc` on a GPU node; ending it removes the file.
A lost GPU answers GPU_IS_LOST; a MIG device handle lists nothing (no mock process
runs in a MIG instance). `nvmlSystemGetProcessName` of a pid the mock does not run is
NOT_FOUND (nvml.h: "if process doesn't exists").
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from driver.nvml.mock.fleet import MockGpu
from driver.nvml.mock.mock_api import NO_INSTANCE, NVML_ERROR_NOT_FOUND, NVMLError, nvml_call
from driver.nvml.processes import MPS_SERVER

FIRST_PID: Final = (1 << 22) + 1  # above the largest pid_max Linux allows
KINDS: Final = ("compute", "mps-client", "mps-server")
_DEFAULT_NAMES: Final = {
    "compute": "/usr/bin/python3",
    "mps-client": "/usr/bin/python3",
    "mps-server": f"/usr/bin/{MPS_SERVER}",
}
_SERVER_BYTES: Final = 32 << 20  # an MPS server's own context


@dataclass(frozen=True)
class MockProcess:
    pid: int
    gpu_index: int
    kind: str  # one of KINDS
    used_bytes: int
    name: str
    pod_uid: str | None = None


@dataclass
class ProcessInfo:  # c_nvmlProcessInfo_v3_t, as pynvml returns it (a friendly object)
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = NO_INSTANCE
    computeInstanceId: int = NO_INSTANCE


def container_cgroup(pod_uid: str, pid: int) -> str:
    """A container cgroup of the pod, as the kubelet (systemd driver, BestEffort) and
    containerd name it."""
    container = hashlib.sha256(f"{pod_uid}/{pid}".encode()).hexdigest()
    pod = pod_uid.replace("-", "_")
    return (
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{pod}.slice/"
        f"cri-containerd-{container}.scope"
    )


class ProcessFunctions:
    """The compute-process part of `MockNvml`."""

    _lock: threading.RLock
    gpus: list[MockGpu]

    if TYPE_CHECKING:

        def mock_gpu(self, uuid: str) -> MockGpu: ...

        def _target(self, handle: Any) -> tuple[MockGpu, Any]: ...

        def refuse_context(self, gpu: MockGpu, processes: Sequence[Any]) -> None: ...

        @property
        def mock_kernel_root(self) -> Path | None: ...

    def _init_processes(self) -> None:
        self._processes: dict[int, MockProcess] = {}
        self._next_pid = itertools.count(FIRST_PID)

    # ------------------------------------------------------------ mock controls

    def start_process(
        self,
        gpu_uuid: str,
        kind: str = "compute",
        *,
        used_bytes: int = 1 << 30,
        name: str | None = None,
        pod_uid: str | None = None,
    ) -> MockProcess:
        """Start a process on the GPU (thread-safe); see the module docstring."""
        if kind not in KINDS:
            raise ValueError(f"unknown process kind {kind!r} (one of {', '.join(KINDS)})")
        if used_bytes < 0:
            raise ValueError(f"used memory {used_bytes} is negative")
        gpu = self.mock_gpu(gpu_uuid)
        with self._lock:
            on_gpu = [p for p in self._processes.values() if p.gpu_index == gpu.index]
            server = any(p.kind == "mps-server" for p in on_gpu)
            if kind != "mps-client" or not server:
                # A context of its own (the client's: its server's): the compute mode
                # may refuse it (driver/nvml/mock/mock_compute_mode.py).
                self.refuse_context(gpu, on_gpu)
            if kind == "mps-client" and not server:
                self._add(gpu.index, "mps-server", _SERVER_BYTES, None, None)
            return self._add(gpu.index, kind, used_bytes, name, pod_uid)

    def end_process(self, pid: int) -> MockProcess:
        """End a mock process (KeyError: no such process)."""
        with self._lock:
            process = self._processes.pop(pid)
        root = self.mock_kernel_root
        if root is not None:
            shutil.rmtree(root / "proc" / str(pid), ignore_errors=True)
        return process

    def processes(self, gpu_uuid: str | None = None) -> list[MockProcess]:
        index = None if gpu_uuid is None else self.mock_gpu(gpu_uuid).index
        with self._lock:
            return [p for p in self._processes.values() if index in (None, p.gpu_index)]

    def _add(
        self, index: int, kind: str, used: int, name: str | None, pod_uid: str | None
    ) -> MockProcess:
        pid = next(self._next_pid)
        process = MockProcess(pid, index, kind, used, name or _DEFAULT_NAMES[kind], pod_uid)
        self._processes[pid] = process
        root = self.mock_kernel_root
        if root is not None and pod_uid is not None:
            path = root / "proc" / str(pid) / "cgroup"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"0::{container_cgroup(pod_uid, pid)}\n")
        return process

    def _cgroup_used(self, gpu_index: int, cgroup: str) -> int:
        """What the GPU's processes in the cgroup directory `cgroup` or below it use:
        a process's cgroup path is below the directory when the directory ends with
        a leading part of that path (the cgroup root's mount left out)."""
        with self._lock:
            processes = [p for p in self._processes.values() if p.gpu_index == gpu_index]
        used = 0
        for p in processes:
            if p.pod_uid is None:
                continue
            parts = container_cgroup(p.pod_uid, p.pid).strip("/").split("/")
            heads = ("/" + "/".join(parts[:k]) for k in range(1, len(parts) + 1))
            if any(cgroup.rstrip("/").endswith(head) for head in heads):
                used += p.used_bytes
        return used

    # ------------------------------------------------------------ pynvml

    def _listed(self, handle: Any, kinds: tuple[str, ...]) -> list[ProcessInfo]:
        gpu, mig = self._target(handle)
        if mig is not None:
            return []
        with self._lock:
            return [
                ProcessInfo(p.pid, p.used_bytes)
                for p in sorted(self._processes.values(), key=lambda p: p.pid)
                if p.gpu_index == gpu.index and p.kind in kinds
            ]

    @nvml_call
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[ProcessInfo]:
        return self._listed(handle, KINDS)

    @nvml_call
    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[ProcessInfo]:
        return self._listed(handle, ("mps-client",))

    @nvml_call
    def nvmlSystemGetProcessName(self, pid: int) -> str:
        with self._lock:
            process = self._processes.get(pid)
        if process is None:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return process.name
