"""NvmlBackend over MockNvml: discovery, NOT_SUPPORTED tolerance, health events."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from driver.nvml import backend as be
from driver.nvml import selection
from driver.nvml.calls import CountingModule
from driver.nvml.discovered import HealthEvent
from driver.nvml.discovery import format_cuda_driver_version, normalize_pci_bus_id
from driver.nvml.health_events import HealthEventSet
from driver.nvml.library import NvmlUnavailableError
from driver.nvml.mock import mock_api as m
from driver.nvml.mock.fleet import default_fleet, example_fleet, mock_gpu_uuid, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml


class Faulty:
    """Delegates to a MockNvml but makes chosen functions raise an NVML error code."""

    def __init__(self, inner: MockNvml, failures: dict[str, int]) -> None:
        self._inner = inner
        self._failures = failures

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in self._failures:
            code = self._failures[name]

            def fail(*args: Any, **kwargs: Any) -> Any:
                raise m.NVMLError(code)

            return fail
        return attr


def test_normalize_pci_bus_id() -> None:
    assert normalize_pci_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_pci_bus_id(b"00000001:AF:00.0\x00") == "0001:af:00.0"
    assert normalize_pci_bus_id("0000:3B:00.0") == "0000:3b:00.0"


def test_format_cuda_driver_version() -> None:
    assert format_cuda_driver_version(13000) == "13.0"
    assert format_cuda_driver_version(12040) == "12.4"
    assert format_cuda_driver_version(11080) == "11.8"


def test_discover_default_fleet() -> None:
    nvml = MockNvml(default_fleet(), "node-a")
    backend = MockBackend(nvml)
    inv = backend.discover()
    assert inv.backend == "mock"
    assert inv.driver_version == "580.95.05" and inv.cuda_driver_version == "13.0"
    assert len(inv.gpus) == 8
    gpu = inv.gpus[3]
    assert gpu.index == 3 and gpu.minor == 3
    assert gpu.uuid == nvml.gpus[3].uuid
    assert gpu.product_name == "NVIDIA H100 80GB HBM3"
    assert gpu.pci_bus_id == "0000:5d:00.0"
    assert gpu.memory_bytes == 81559 * 2**20
    assert (gpu.brand, gpu.architecture, gpu.cuda_compute_capability) == ("Nvidia", "Hopper", "9.0")
    assert gpu.mig_capable and gpu.mig_enabled
    assert gpu.memory_slices == 8 and gpu.multiprocessors == 132
    names = {p.name: p for p in gpu.partition_profiles}
    assert set(names) == {
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    }
    p = names["1g.20gb"]
    assert p.profile_id == 15 and p.memory_bytes == 20096 * 2**20
    assert p.placements == ((0, 2), (2, 2), (4, 2), (6, 2)) and p.instance_count == 4
    assert not gpu.reference_example and gpu.model is None
    # Balanced init/shutdown.
    assert nvml.calls["nvmlInit"] == nvml.calls["nvmlShutdown"] == 1


def test_discover_example_fleet_marks_reference_gpus() -> None:
    inv = MockBackend(MockNvml(example_fleet(), "n")).discover()
    assert inv.driver_version == "1.0.0"
    for gpu in inv.gpus:
        assert gpu.reference_example and gpu.model == "LATEST-GPU-MODEL"
        assert gpu.brand is None and gpu.architecture is None
        assert gpu.cuda_compute_capability is None
        assert not gpu.mig_capable and gpu.partition_profiles == () and gpu.memory_slices == 0


def test_not_supported_leaves_fields_none() -> None:
    inner = MockNvml(default_fleet(), "n")
    failures = {
        "nvmlDeviceGetMemoryInfo": m.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetBrand": m.NVML_ERROR_NOT_SUPPORTED,
        "nvmlDeviceGetArchitecture": m.NVML_ERROR_FUNCTION_NOT_FOUND,
        "nvmlDeviceGetCudaComputeCapability": m.NVML_ERROR_NOT_SUPPORTED,
        "nvmlSystemGetCudaDriverVersion": m.NVML_ERROR_NOT_SUPPORTED,
    }
    inv = be.NvmlBackend(Faulty(inner, failures), backend_name="nvml").discover()
    assert inv.backend == "nvml" and inv.cuda_driver_version is None
    gpu = inv.gpus[0]
    assert gpu.memory_bytes is None and gpu.brand is None
    assert gpu.architecture is None and gpu.cuda_compute_capability is None
    assert gpu.mig_capable and len(gpu.partition_profiles) == 7


def test_mig_not_supported_means_not_capable() -> None:
    inner = MockNvml(default_fleet(), "n")
    faulty = Faulty(inner, {"nvmlDeviceGetMigMode": m.NVML_ERROR_NOT_SUPPORTED})
    gpu = be.NvmlBackend(faulty).discover().gpus[0]
    assert not gpu.mig_capable and gpu.partition_profiles == ()
    assert inner.calls["nvmlDeviceGetGpuInstanceProfileInfo"] == 0


def test_mig_disabled_is_capable_but_not_enabled() -> None:
    fleet = parse_fleet({"gpus": [{"model": "A100-40GB", "migMode": "disabled"}]})
    gpu = MockBackend(MockNvml(fleet, "n")).discover().gpus[0]
    assert gpu.mig_capable and not gpu.mig_enabled
    assert {p.name for p in gpu.partition_profiles} >= {"1g.5gb", "7g.40gb"}


def test_other_errors_fail_discovery() -> None:
    inner = MockNvml(default_fleet(), "n")
    faulty = Faulty(inner, {"nvmlDeviceGetMemoryInfo": m.NVML_ERROR_UNKNOWN})
    with pytest.raises(m.NVMLError):
        be.NvmlBackend(faulty).discover()
    assert inner.calls["nvmlShutdown"] == 1  # still shut down


def test_lost_gpu_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    nvml = MockNvml(default_fleet(), "n")
    nvml.inject_gpu_lost(nvml.gpus[2].uuid)
    with caplog.at_level(logging.WARNING):
        inv = MockBackend(nvml).discover()
    assert [g.index for g in inv.gpus] == [0, 1, 3, 4, 5, 6, 7]
    assert "lost" in caplog.text


def test_missing_library_is_a_clear_error() -> None:
    inner = MockNvml(default_fleet(), "n")
    faulty = Faulty(inner, {"nvmlInit": m.NVML_ERROR_LIBRARY_NOT_FOUND})
    with pytest.raises(NvmlUnavailableError, match="--mock"):
        be.NvmlBackend(faulty).discover()


def _monitor(fleet_gpus: int = 2) -> tuple[MockNvml, be.NvmlBackend]:
    nvml = MockNvml(parse_fleet({"gpus": [{"model": "H100-80GB", "count": fleet_gpus}]}), "n")
    backend = MockBackend(nvml)
    backend.open_event_set()
    return nvml, backend


def test_wait_event_requires_an_event_set() -> None:
    backend = MockBackend(MockNvml(default_fleet(), "n"))
    with pytest.raises(RuntimeError):
        backend.wait_event(0)


def test_events_xid_ecc_timeout() -> None:
    nvml, backend = _monitor()
    uuid = nvml.gpus[1].uuid
    assert backend.monitored_uuids == tuple(g.uuid for g in nvml.gpus)
    assert backend.wait_event(10) is None
    nvml.inject_xid(uuid, 79)
    event = backend.wait_event(10)
    assert event is not None and (event.gpu_uuid, event.kind, event.xid) == (uuid, "xid", 79)
    nvml.inject(HealthEvent(gpu_uuid=uuid, kind="ecc-dbe"))
    event = backend.wait_event(10)
    assert event is not None and event.kind == "ecc-dbe" and event.xid is None
    backend.close_event_set()
    assert nvml.calls["nvmlEventSetFree"] == 1
    assert nvml.calls["nvmlInit"] == nvml.calls["nvmlShutdown"]


def test_gpu_lost_reported_once_then_recovered() -> None:
    nvml, backend = _monitor(3)
    uuid = nvml.gpus[2].uuid
    nvml.inject_gpu_lost(uuid)
    event = backend.wait_event(10)
    assert event is not None and (event.gpu_uuid, event.kind) == (uuid, "gpu-lost")
    assert backend.wait_event(10) is None
    nvml.reset(uuid)
    event = backend.wait_event(10)
    assert event is not None and (event.gpu_uuid, event.kind) == (uuid, "recovered")


def test_two_gpus_lost_at_once_are_both_reported() -> None:
    nvml, backend = _monitor(3)
    nvml.inject_gpu_lost(nvml.gpus[0].uuid)
    nvml.inject_gpu_lost(nvml.gpus[1].uuid)
    events = [backend.wait_event(10), backend.wait_event(10)]
    assert {(e.gpu_uuid, e.kind) for e in events if e is not None} == {
        (nvml.gpus[0].uuid, "gpu-lost"),
        (nvml.gpus[1].uuid, "gpu-lost"),
    }


def test_gpu_unavailable_event_maps_to_gpu_lost() -> None:
    nvml = MockNvml(parse_fleet({"gpus": [{"model": "H100-80GB", "count": 2}]}), "n")
    events = HealthEventSet(CountingModule(nvml))
    events.open()
    data = m.EventData(
        device=nvml.nvmlDeviceGetHandleByIndex(0),
        eventType=m.nvmlEventTypeGpuUnavailableError,
        eventData=0,
    )
    event = events._translate(data)
    assert event is not None and event.kind == "gpu-lost"
    assert events._translate(data) is None  # already known lost
    action = m.EventData(
        device=nvml.nvmlDeviceGetHandleByIndex(0),
        eventType=m.nvmlEventTypeGpuRecoveryAction,
        eventData=m.NVML_GPU_RECOVERY_ACTION_GPU_RESET,
    )
    assert events._translate(action) is None


def test_select_backend_mock_logs_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="driver.nvml.backend"):
        backend = selection.select_backend(mock=True, node_name="n1")
    assert isinstance(backend.module, MockNvml)
    assert backend.backend_name == "mock"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "MOCK NVML" in warnings[0].getMessage()
    assert "8x" in warnings[0].getMessage()
    with pytest.raises(ValueError, match="node name"):
        selection.select_backend(mock=True, node_name="")


def test_select_backend_real_uses_pynvml_without_calling_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import pynvml

    with caplog.at_level(logging.WARNING):
        backend = selection.select_backend(mock=False, node_name="n1")
    assert backend.module is pynvml and backend.backend_name == "nvml"
    assert "MOCK" not in caplog.text


def test_select_backend_loads_nvml_from_the_driver_root_it_is_given(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's --nvidia-driver-root, not only the environment, names where
    libnvidia-ml is loaded from."""
    monkeypatch.delenv("NVIDIA_DRIVER_ROOT", raising=False)
    with pytest.raises(selection.NvmlUnavailableError, match=f"{tmp_path}: no libnvidia-ml"):
        selection.select_backend(mock=False, node_name="n1", driver_root=tmp_path)


def test_select_backend_with_fleet_file(tmp_path: Any) -> None:
    path = tmp_path / "f.yaml"
    path.write_text("gpus:\n- model: example\n  count: 2\n")
    backend = selection.select_backend(mock=True, fleet_path=path, node_name="test-node")
    inv = backend.discover()
    assert [g.uuid for g in inv.gpus] == [
        mock_gpu_uuid("test-node", i, prefix="gpu") for i in (0, 1)
    ]


def test_only_the_backend_selection_reaches_the_mock() -> None:
    """The real NVML path never imports the mock: outside `driver/nvml/mock/`, only
    the backend selection (`driver/nvml/selection.py`) names it, and `gpu-dra mock`
    (`driver/cli/mock.py`, the mock's own client: the requests it sends, imported when
    it runs; tests/unit/test_real_backend_imports.py checks that building the CLI
    imports nothing of the mock)."""
    driver_dir = Path(be.__file__).resolve().parents[1]
    importers = sorted(
        str(path.relative_to(driver_dir.parent))
        for path in driver_dir.rglob("*.py")
        if "mock" not in path.relative_to(driver_dir).parts[:2]
        and "driver.nvml.mock" in path.read_text()
    )
    assert importers == ["driver/cli/mock.py", "driver/nvml/selection.py"]
