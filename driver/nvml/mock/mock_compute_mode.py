"""The mock NVML's compute modes: `nvmlDeviceGetComputeMode`,
`nvmlDeviceSetComputeMode`, and what a mode does to the CUDA contexts the mock's
processes open (driver/nvml/mock/mock_processes.py).

`ComputeModeFunctions` is mixed into `MockNvml`. As nvml.h declares them:

- Get and Set take a device handle; INVALID_ARGUMENT for an invalid handle,
  GPU_IS_LOST for a lost GPU. The mock keeps a mode per GPU with MIG off and answers
  NOT_SUPPORTED for a MIG device handle and for a GPU in MIG mode (NVML wants a MIG
  device handle there; this driver never asks);
- Set only: INVALID_ARGUMENT for a mode outside `nvmlComputeMode_t`, NOT_SUPPORTED
  for `EXCLUSIVE_THREAD` ("Support Removed"), NO_PERMISSION unless the caller is root
  ("Requires root/admin permissions"; `privileged`, the process's effective uid by
  default, shared with the memory limits).

Kept in memory, or, with a driver root, in `<root>/run/nvidia-mock/compute-mode.json`
(`{"version": 1, "gpus": {"<GPU UUID>": 3}}`; a GPU in `DEFAULT` is not listed), so a
plugin, its restart and a CLI on the same driver root see the same modes, as the
driver keeps a GPU's mode while processes come and go. `mock_reboot()` resets every
GPU to `DEFAULT` ("not persistent across reboots"). Reads and writes take an
exclusive `flock` on `compute-mode.lock`; writes are atomic.

What a mode refuses (`refuse_context`), as CUDA reports it: in `EXCLUSIVE_PROCESS` a
GPU takes one CUDA context, so a process that opens one while another process holds
one (a process outside MPS, or an MPS server) fails with
`cudaErrorDevicesUnavailable`, "all CUDA-capable devices are busy or unavailable";
in `PROHIBITED` none. An MPS client has no context of its own: it uses its server's,
so it is accepted while its server runs; its server, started for the first client,
needs the one context (NVIDIA's MPS guide: in `EXCLUSIVE_PROCESS` "only one MPS
server" runs on the GPU).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from driver.nvml.mock.fleet import MockGpu
from driver.nvml.mock.mock_api import (
    NVML_COMPUTEMODE_COUNT,
    NVML_COMPUTEMODE_DEFAULT,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
    NVML_COMPUTEMODE_PROHIBITED,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVMLError,
    nvml_call,
)
from driver.nvml.mock.mock_timeslice import _atomic_write

STATE_FILE: Final = Path("run/nvidia-mock/compute-mode.json")
# The kinds of mock process that hold a CUDA context of their own.
CONTEXT_KINDS: Final = ("compute", "mps-server")
_NAMES: Final = {
    NVML_COMPUTEMODE_DEFAULT: "Default",
    NVML_COMPUTEMODE_PROHIBITED: "Prohibited",
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "Exclusive_Process",
}


class DevicesUnavailable(RuntimeError):
    """A CUDA context the GPU's compute mode refuses (`cudaErrorDevicesUnavailable`)."""


class _Process(Protocol):
    @property
    def pid(self) -> int: ...
    @property
    def kind(self) -> str: ...


class ComputeModeFunctions:
    """The compute-mode part of `MockNvml`."""

    _lock: threading.RLock
    privileged: bool

    if TYPE_CHECKING:

        def _not_mig(self, handle: Any) -> MockGpu: ...

        def mock_gpu(self, uuid: str) -> MockGpu: ...

        @property
        def mock_kernel_root(self) -> Path | None: ...

    def _init_compute_modes(self) -> None:
        self._compute_modes: dict[str, int] = {}  # without a driver root
        self._compute_mode_lock = threading.Lock()

    @contextlib.contextmanager
    def _modes(self) -> Iterator[dict[str, int]]:
        """GPU UUID -> mode of every GPU not in DEFAULT, saved when the block ends
        without an exception."""
        with self._compute_mode_lock:
            root = self.mock_kernel_root
            if root is None:
                modes = dict(self._compute_modes)
                yield modes
                self._compute_modes = modes
                return
            path = root / STATE_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                before = json.loads(path.read_text())["gpus"] if path.exists() else {}
                modes = dict(before)
                yield modes
                if modes != before:
                    doc = {"version": 1, "gpus": modes}
                    _atomic_write(path, json.dumps(doc, sort_keys=True) + "\n")

    def _mode_target(self, handle: Any) -> MockGpu:
        gpu = self._not_mig(handle)
        if gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # ------------------------------------------------------------ mock controls

    def compute_mode(self, gpu_uuid: str) -> int:
        """The GPU's compute mode, without an NVML call (tests, the mock's processes)."""
        uuid = self.mock_gpu(gpu_uuid).uuid
        with self._modes() as modes:
            return modes.get(uuid, NVML_COMPUTEMODE_DEFAULT)

    def _reset_compute_modes(self) -> None:
        """Every GPU back to DEFAULT (a reboot)."""
        with self._modes() as modes:
            modes.clear()

    def refuse_context(self, gpu: MockGpu, processes: Sequence[_Process]) -> None:
        """Raise `DevicesUnavailable` where the GPU's compute mode refuses a new CUDA
        context, `processes` being the GPU's mock processes now."""
        mode = self.compute_mode(gpu.uuid)
        holders = [p for p in processes if p.kind in CONTEXT_KINDS]
        if mode == NVML_COMPUTEMODE_PROHIBITED:
            why = "no CUDA context is allowed"
        elif mode == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS and holders:
            why = f"process {holders[0].pid} ({holders[0].kind}) holds its one CUDA context"
        else:
            return
        raise DevicesUnavailable(
            "cudaErrorDevicesUnavailable: all CUDA-capable devices are busy or unavailable "
            f"(GPU {gpu.uuid} is in compute mode {_NAMES[mode]}: {why})"
        )

    # ------------------------------------------------------------ pynvml

    @nvml_call
    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        gpu = self._mode_target(handle)
        with self._modes() as modes:
            return modes.get(gpu.uuid, NVML_COMPUTEMODE_DEFAULT)

    @nvml_call
    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        gpu = self._mode_target(handle)
        if isinstance(mode, bool) or not isinstance(mode, int):
            mode = getattr(mode, "value", -1)  # a ctypes value, as pynvml passes it
        if not 0 <= mode < NVML_COMPUTEMODE_COUNT:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if mode == NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not self.privileged:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        with self._modes() as modes:
            if mode == NVML_COMPUTEMODE_DEFAULT:
                modes.pop(gpu.uuid, None)
            else:
                modes[gpu.uuid] = mode
