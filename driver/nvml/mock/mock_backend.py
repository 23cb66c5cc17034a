"""The mock's `NvmlBackend`: `select_backend(mock=True)` builds it (`mock_backend`), and
nothing on the real NVML path imports this module.

Over a `MockNvml`, the backend's hooks bring the mock's stand-ins along: time-slice
settings kept under the mock's own driver root (`MockTimeSlice`), its stand-in for
`nvidia-cuda-mps-control` there, the reference's published model for the `example`
profile, and its control actions (`driver.nvml.mock.mock_control`: `gpu-dra mock ...`),
which the plugin registers on its control requests. Those are taken between NVML event
waits: over the mock the wait is short (`event_wait_ms`), standing in for NVML waking
a wait at once, so an injected event is not delayed by its transport.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from driver.nvml.backend import ControlHandler, MigInstances, NvmlBackend
from driver.nvml.discovered import Inventory
from driver.nvml.mock.fleet import resolve_fleet
from driver.nvml.mock.mock_control import MockActions
from driver.nvml.mock.mock_timeslice import MockTimeSlice
from driver.nvml.mock.mps_control import install_mps_control
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.mps import MpsControl

log = logging.getLogger(__name__)


class MockBackend(NvmlBackend):
    """An `NvmlBackend` over a `MockNvml`, with the mock's stand-ins."""

    event_wait_ms: ClassVar[int] = 20

    def __init__(self, nvml: MockNvml, *, kernel_root: Path = Path("/")) -> None:
        super().__init__(nvml, backend_name="mock", kernel_root=kernel_root)
        self._mock = nvml

    @property
    def mock_module(self) -> MockNvml:
        """The mock NVML this backend runs over (its fault injection: `gpu-dra mock`)."""
        return self._mock

    def _new_timeslice(self, driver_root: Path | str) -> MockTimeSlice:
        """The mock's settings, under its own driver root (`driver_root` is unused)."""
        uuids = [gpu.uuid for gpu in self._mock.gpus]
        return MockTimeSlice(self._mock.mig_store.root, uuids, is_lost=self._mock.is_lost)

    def mps(self, driver_root: Path | str) -> MpsControl | None:
        """The stand-in MPS control daemon its own driver root holds (`driver_root` is
        unused); None without a driver root."""
        root = self._mock.mig_store.root
        if root is None:
            return None
        install_mps_control(root)
        return super().mps(root)

    def discover(self) -> Inventory:
        # The mock's `example` profile publishes the reference's model, not NVML's.
        return self._mock.as_published(super().discover())

    def control_actions(
        self, devices: Any, mig_instances: MigInstances | None = None
    ) -> dict[str, ControlHandler]:
        """`xid`, `lost`, `reset`, `recovery-action` and `process` on the published
        `devices`; a
        GPU instance is looked up by `mig_instances` (default: this backend's MIG
        manager, its calls counted)."""
        instances = mig_instances if mig_instances is not None else self.mig().instances
        return MockActions(self._mock, devices, mig_instances=instances).handlers()


def mock_backend(
    fleet_path: str | Path | None, node_name: str, driver_root: Path | None
) -> MockBackend:
    """The mock fleet `fleet_path` (a YAML file or a built-in name; None: the default)
    for `node_name`, with its MIG state and capability files under `driver_root`.
    Logged loudly at WARNING: its devices must never be published by accident on a
    real GPU node."""
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
    return MockBackend(
        MockNvml(fleet, node_name, driver_root=driver_root),
        kernel_root=driver_root or Path("/"),
    )
