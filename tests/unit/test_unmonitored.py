"""A GPU whose NVML health events cannot be registered: published, counted, shown.

NVML may refuse `nvmlDeviceRegisterEvents` for one GPU (an old driver, a vGPU:
NOT_SUPPORTED). Before, that ended the event set's opening for every GPU and the
monitor retried forever, with a log line as the only trace. Now the other GPUs are
watched, and every device of that GPU carries `<driver>/unmonitored` with effect None
(informational, as NVIDIA's driver publishes it), counted in gpu_dra_unmonitored_gpus
and shown by `gpu-dra status`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driver.devices.model import build_pool
from driver.health.monitor import HealthMonitor
from driver.health.store import HealthStore
from driver.health.unmonitored import UnmonitoredGpus
from driver.health.xid import XidPolicy
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.mock_api import NVML_ERROR_NOT_SUPPORTED, NVMLError
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.observability.metrics import REGISTRY
from tests.unit.test_health_monitor import FakePublisher

DRIVER = "gpu.example.com"


class RefusingNvml(MockNvml):
    """The mock, refusing to register events for the GPU at NVML index `refused`."""

    def __init__(self, refused: int) -> None:
        super().__init__(default_fleet(), "node-1")
        self.refused = refused

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        if getattr(handle, "index", None) == self.refused:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        super().nvmlDeviceRegisterEvents(handle, eventTypes, eventSet)


def test_a_gpu_whose_events_cannot_be_registered_is_published_unmonitored(
    tmp_path: Path,
) -> None:
    mock = RefusingNvml(3)
    backend = MockBackend(mock)
    pool = build_pool(backend.discover())
    store = HealthStore(tmp_path / "health.json")
    publisher = FakePublisher()
    unmonitored = UnmonitoredGpus(pool.devices, driver=DRIVER)
    monitor = HealthMonitor(
        backend, store, XidPolicy(), publisher, pool.devices, unmonitored=unmonitored
    )
    uuid3, uuid0 = mock.gpus[3].uuid, mock.gpus[0].uuid
    try:
        monitor.run_once()  # opens the event set: gpu-3's registration is refused
        (reason,) = unmonitored.reasons().values()
        assert list(unmonitored.reasons()) == [uuid3]
        assert "cannot register its health events" in reason and "Not Supported" in reason
        assert publisher.triggers, "the taint is published at once"
        gpu3 = {d.name for d in pool.devices_of_gpu(uuid3)}
        taints = unmonitored.add_taints({})
        assert set(taints) == gpu3 and len(gpu3) > 1  # the GPU and its partitions
        assert all(
            t == [{"key": f"{DRIVER}/unmonitored", "effect": "None"}] for t in taints.values()
        )
        assert REGISTRY.get_sample_value("gpu_dra_unmonitored_gpus") == 1

        # The other GPUs are watched.
        mock.inject_xid(uuid0, 79)
        while monitor.run_once() is None:
            pass
        assert store.gpu_failure(uuid0) is not None
    finally:
        monitor.stop()
