"""NVML discovery and health events over a pynvml-compatible module.

`NvmlBackend(module)` takes the real `pynvml` module or a `MockNvml` instance and only
calls functions that exist in real pynvml (tests/unit/test_pynvml_contract.py checks
names and signatures). Discovery lives in `driver.nvml.discovery`, the health event
set in `driver.nvml.events`, the recovery action in `driver.nvml.recovery`, the
counted calls in `driver.nvml.calls` and loading the library in
`driver.nvml.library`; this module puts them together for one process.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from driver.nvml.calls import CountingModule
from driver.nvml.discovery import discover_inventory
from driver.nvml.events import HealthEventSet
from driver.nvml.library import NvmlUnavailableError, load_library_from_driver_root
from driver.nvml.mig import MigManager
from driver.nvml.mps import MpsControl
from driver.nvml.recovery import RecoveryActionReader, RecoveryReading
from driver.nvml.timeslice import NvidiaSmiTimeSlice
from driver.nvml.types import HealthEvent, Inventory

if TYPE_CHECKING:
    from driver.nvml.mock.nvml import MockNvml
    from driver.nvml.mock.timeslice import MockTimeSlice

_MOCK_MODULE = "driver.nvml.mock.nvml"

log = logging.getLogger(__name__)


class NvmlBackend:
    """Discovery and health events through a pynvml-compatible module."""

    def __init__(
        self, module: Any, *, backend_name: str | None = None, kernel_root: Path = Path("/")
    ) -> None:
        self._nvml = CountingModule(module)
        # Where the kernel's /proc of these GPUs is (device majors, MIG capabilities):
        # the host's, or the mock driver root the mock writes its own into.
        self.kernel_root = kernel_root
        self._mock = module if _is_mock(module) else None
        if backend_name is None:
            backend_name = "nvml" if self._mock is None else "mock"
        self.backend_name = backend_name
        self._events = HealthEventSet(self._nvml)
        self._recovery = RecoveryActionReader(self._nvml)
        self._timeslice: NvidiaSmiTimeSlice | MockTimeSlice | None = None
        self._mig = MigManager(self._nvml)

    @property
    def module(self) -> Any:
        return self._nvml.wrapped

    @property
    def mock_module(self) -> MockNvml | None:
        """The mock NVML this backend runs over (its fault injection: `gpu-dra mock`)."""
        return self._mock

    def mig(self) -> MigManager:
        """The MIG lifecycle on this backend's GPUs (calls are counted like all others):
        one manager, so its per-GPU serialisation holds for every caller."""
        return self._mig

    def timeslice(self, driver_root: Path | str) -> NvidiaSmiTimeSlice | MockTimeSlice:
        """GPU time-slice intervals on this backend's GPUs: `nvidia-smi` from
        `driver_root` (the plugin's `--nvidia-driver-root`), or, for the mock, its
        settings kept under the mock's own driver root (`driver_root` is unused)."""
        if self._timeslice is None:
            if self._mock is not None:
                from driver.nvml.mock.timeslice import MockTimeSlice

                uuids = [gpu.uuid for gpu in self._mock.gpus]
                self._timeslice = MockTimeSlice(
                    self._mock.mig_store.root, uuids, is_lost=self._mock.is_lost
                )
            else:
                self._timeslice = NvidiaSmiTimeSlice(driver_root)
        return self._timeslice

    def mps(self, driver_root: Path | str) -> MpsControl | None:
        """MPS control daemons from `driver_root`'s `nvidia-cuda-mps-control` (the
        mock: the stand-in its own driver root holds), None where there is none."""
        if self._mock is not None:
            root = self._mock.mig_store.root
            if root is None:
                return None
            from driver.nvml.mock.mps_control import install_mps_control

            install_mps_control(root)
            driver_root = root
        control = MpsControl(driver_root)
        return control if control.available() else None

    @property
    def nvml_calls(self) -> dict[str, int]:
        """NVML functions called through this backend since it was created, by the
        name of the calling thread."""
        return dict(self._nvml.counts)

    def discover(self) -> Inventory:
        """Walk every GPU NVML reports; GPUs that are lost are skipped with a warning."""
        inventory = discover_inventory(self._nvml, self.backend_name, self._mig)
        if self._mock is not None:
            # The mock's `example` profile publishes the reference's model, not NVML's.
            inventory = self._mock.as_published(inventory)
        return inventory

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
        """NVML's recovery action of each GPU (`driver.nvml.recovery`)."""
        return self._recovery.read(uuids)

    def wait_event(self, timeout_ms: int) -> HealthEvent | None:
        """The next health event, or None when `timeout_ms` passes without one
        (`HealthEventSet.wait` says how NVML events map to HealthEvents)."""
        return self._events.wait(timeout_ms)


def _is_mock(module: Any) -> bool:
    """Whether `module` is a MockNvml, without importing the mock on the real path: a
    MockNvml instance can only exist once its module has been imported."""
    mock_module = sys.modules.get(_MOCK_MODULE)
    return mock_module is not None and isinstance(module, mock_module.MockNvml)


def check_mock_fleet(fleet_path: str | Path | None) -> None:
    """ValueError where the mock fleet (a YAML file or a built-in name) cannot be
    loaded: the plugin's settings check it before anything touches the host."""
    from driver.nvml.mock.fleet import resolve_fleet

    resolve_fleet(fleet_path)


def select_backend(
    *,
    mock: bool,
    fleet_path: str | Path | None = None,
    node_name: str = "",
    mock_driver_root: Path | None = None,
    driver_root: Path | str | None = None,
) -> NvmlBackend:
    """The backend for this process: real pynvml, or (explicitly chosen) a mock fleet.

    Real NVML is loaded from `driver_root` (the plugin's `--nvidia-driver-root`;
    default: the NVIDIA_DRIVER_ROOT environment variable, else the loader's path).
    The mock is logged loudly at WARNING: its devices must never be published by
    accident on a real GPU node.
    """
    if mock:
        from driver.nvml.mock.fleet import resolve_fleet
        from driver.nvml.mock.nvml import MockNvml

        if not node_name:
            raise ValueError("the mock backend needs a node name (UUIDs derive from it)")
        fleet = resolve_fleet(fleet_path)
        count = sum(g.count for g in fleet.gpus)
        log.warning(
            "USING MOCK NVML: %d fake GPU(s) (%s) for node %s from %s; these are not real devices",
            count,
            ", ".join(f"{g.count}x{g.model}" for g in fleet.gpus),
            node_name,
            fleet_path or "the built-in default fleet",
        )
        return NvmlBackend(
            MockNvml(fleet, node_name, driver_root=mock_driver_root),
            kernel_root=mock_driver_root or Path("/"),
        )
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - pynvml is a hard dependency
        raise NvmlUnavailableError(f"pynvml is not installed: {err}") from err
    if driver_root is None:
        driver_root = os.environ.get("NVIDIA_DRIVER_ROOT", "")
    load_library_from_driver_root(pynvml, str(driver_root))
    return NvmlBackend(pynvml)
