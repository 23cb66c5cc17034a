"""NVML discovery, health events and GPU operations over a pynvml-compatible module.

`NvmlBackend(module)` takes the real `pynvml` module (or a pynvml-compatible one) and
only calls functions that exist in real pynvml (tests/unit/test_pynvml_contract.py
checks names and signatures). Each concern lives in its own `driver.nvml` module;
this one puts them together for one process, every NVML call counted (`calls`).

The mock's backend subclasses `NvmlBackend`: its hooks (`control_actions`,
`event_wait_ms`, the time-slice and MPS stand-ins) are where it differs; the selection
of a backend (`driver.nvml.selection`) is the only way to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from driver.nvml.calls import CountingModule
from driver.nvml.compute_mode import NvmlComputeModes
from driver.nvml.discovered import HealthEvent, Inventory
from driver.nvml.discovery import discover_inventory
from driver.nvml.health_events import HealthEventSet
from driver.nvml.library import GpuHandles
from driver.nvml.memory_limits import GpuMemoryLimits
from driver.nvml.mig.mig_manager import MigManager
from driver.nvml.mps import MpsControl
from driver.nvml.processes import GpuProcesses, ProcessReader
from driver.nvml.recovery_action import RecoveryActionReader, RecoveryReading
from driver.nvml.smi_timeslice import NvidiaSmiTimeSlice

if TYPE_CHECKING:
    from driver.state.claim_timeslices import TimeSliceOps

log = logging.getLogger(__name__)

# A control action's handler (`driver.health.control_queue.Handler`): the request's JSON
# object -> the answer's fields; raises `driver.health.control_queue.ControlError` to refuse.
ControlHandler = Callable[[dict[str, Any]], dict[str, Any]]
MigInstances = Callable[[str], Iterable[Any]]  # GPU UUID -> its live GPU instances


class NvmlBackend:
    """Discovery and health events through a pynvml-compatible module."""

    # How long the health monitor's one NVML event wait may take: NVML ends a wait at
    # once for an event, so this only bounds how late a control request is taken.
    event_wait_ms: ClassVar[int] = 100

    def __init__(
        self, module: Any, *, backend_name: str = "nvml", kernel_root: Path = Path("/")
    ) -> None:
        self._nvml = CountingModule(module)
        # Where the kernel's /proc of these GPUs is (device majors, MIG capabilities):
        # the host's, or the mock driver root the mock writes its own into.
        self.kernel_root = kernel_root
        self.backend_name = backend_name
        self._events = HealthEventSet(self._nvml)
        gpus = GpuHandles(self._nvml)  # one scan, one forget, for every reader below
        self._recovery = RecoveryActionReader(self._nvml, gpus)
        self._timeslice: TimeSliceOps | None = None
        self._mig = MigManager(self._nvml)
        self._processes = ProcessReader(self._nvml, gpus)
        self._memory_limits = GpuMemoryLimits(self._nvml, gpus)
        self._compute_modes = NvmlComputeModes(self._nvml, gpus)

    @property
    def module(self) -> Any:
        return self._nvml.wrapped

    def mig(self) -> MigManager:
        """The MIG lifecycle on this backend's GPUs (calls are counted like all others):
        one manager, so its per-GPU serialisation holds for every caller."""
        return self._mig

    def timeslice(self, driver_root: Path | str) -> TimeSliceOps:
        """GPU time-slice intervals on this backend's GPUs: `nvidia-smi` from
        `driver_root` (the plugin's `--nvidia-driver-root`)."""
        if self._timeslice is None:
            self._timeslice = self._new_timeslice(driver_root)
        return self._timeslice

    def _new_timeslice(self, driver_root: Path | str) -> TimeSliceOps:
        return NvidiaSmiTimeSlice(driver_root)

    def mps(self, driver_root: Path | str) -> MpsControl | None:
        """MPS control daemons from `driver_root`'s `nvidia-cuda-mps-control`, None
        where there is none."""
        control = MpsControl(driver_root)
        return control if control.available() else None

    def control_actions(self, devices: Any) -> Mapping[str, ControlHandler]:
        """The control actions this backend adds to the plugin's (`driver.health.control_queue`)
        for the published `devices`: none on real NVML."""
        return {}

    @property
    def nvml_calls(self) -> dict[str, int]:
        """NVML functions called through this backend since it was created, by the
        name of the calling thread."""
        return dict(self._nvml.counts)

    def discover(self) -> Inventory:
        """Walk every GPU NVML reports; GPUs that are lost are skipped with a warning."""
        return discover_inventory(self._nvml, self.backend_name, self._mig)

    def open_event_set(self) -> None:
        """Initialise NVML and register every GPU for health-relevant events."""
        self._events.open()

    def close_event_set(self) -> None:
        self._events.close()

    @property
    def monitored_uuids(self) -> tuple[str, ...]:
        return self._events.monitored_uuids

    @property
    def unmonitored(self) -> dict[str, str]:
        """GPU UUID -> why its health events are not watched (`HealthEventSet`)."""
        return self._events.unmonitored

    def recovery_actions(self, uuids: Iterable[str]) -> list[RecoveryReading]:
        """NVML's recovery action of each GPU (`driver.nvml.recovery_action`)."""
        return self._recovery.read(uuids)

    def gpu_processes(self, gpu_uuid: str) -> GpuProcesses:
        """The GPU's compute processes and which use MPS (`driver.nvml.processes`)."""
        return self._processes.read(gpu_uuid)

    def compute_modes(self) -> NvmlComputeModes:
        """The GPUs' compute modes (`driver.nvml.compute_mode`): EXCLUSIVE_PROCESS for
        a GPU whose one MPS daemon holds it whole (docs/mps.md)."""
        return self._compute_modes

    def memory_limits(self) -> GpuMemoryLimits:
        """Per-cgroup GPU memory limits kept by the kernel driver, where the driver
        has them (R615 and later; `driver.nvml.memory_limits`)."""
        return self._memory_limits

    def wait_event(self, timeout_ms: int) -> HealthEvent | None:
        """The next health event, or None when `timeout_ms` passes without one
        (`HealthEventSet.wait` says how NVML events map to HealthEvents)."""
        return self._events.wait(timeout_ms)
