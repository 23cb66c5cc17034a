"""Discovery, events and the prepare of a whole GPU on a real GPU (`make test-gpu`);
the MIG lifecycle is in test_mig.py."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo, Inventory
from driver.nvml.mig.mig_manager import MigError, MigTarget
from tests.gpu.node import open_node


def test_discovery_reports_every_gpu_with_its_device_node(
    inventory: Inventory, pynvml_session: Any
) -> None:
    assert len(inventory.gpus) == int(pynvml_session.nvmlDeviceGetCount())
    for gpu in inventory.gpus:
        assert gpu.uuid.startswith("GPU-"), gpu.uuid
        assert gpu.memory_bytes is not None and gpu.memory_bytes > 0
        assert Path(f"/dev/nvidia{gpu.minor}").exists(), f"/dev/nvidia{gpu.minor}"
        if gpu.mig_enabled:
            assert gpu.partition_profiles, f"{gpu.uuid}: MIG on but no profiles"
    print(
        "GPUs:",
        ", ".join(
            f"{g.minor}:{g.product_name} MIG={'on' if g.mig_enabled else 'off'}"
            for g in inventory.gpus
        ),
    )


def test_event_wait_blocks_without_spinning(backend: NvmlBackend) -> None:
    backend.open_event_set()
    try:
        # Every GPU of a supported driver registers its health events: none is published
        # `unmonitored` (driver/health/unmonitored.py).
        assert backend.unmonitored == {}, backend.unmonitored
        assert backend.monitored_uuids
        cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        for _ in range(3):
            backend.wait_event(500)  # a healthy GPU: no event, the wait times out
        cpu1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - wall0
    finally:
        backend.close_event_set()
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    print(f"3 waits of 500 ms: {wall:.2f} s wall, {cpu:.3f} s CPU")
    assert wall >= 1.2, "the wait returned early: busy loop or no timeout"
    assert cpu < 0.3 * wall, "waiting for events burns CPU"


def _nodes_exist(spec: dict[str, Any]) -> None:
    paths = [n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
    paths += [n["path"] for n in spec["containerEdits"].get("deviceNodes", [])]
    missing = [p for p in paths if not os.path.exists(p)]
    assert not missing, f"device nodes missing on the host: {missing}"


def test_prepare_of_a_gpu_yields_a_spec_whose_device_nodes_exist(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    node = open_node(backend, tmp_path)
    device = f"gpu-{whole_gpu.minor}"
    ref = node.claims.add("whole", device)
    started = time.monotonic()
    result = node.state.prepare([ref])["whole"]
    print(f"prepare of {device}: {1000 * (time.monotonic() - started):.1f} ms")
    assert result.ok, result.error
    spec = node.spec("whole")
    _nodes_exist(spec)
    edits = spec["devices"][0]["containerEdits"]
    assert edits["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"
    gpu_node = edits["deviceNodes"][0]
    host = os.stat(gpu_node["path"])
    assert (gpu_node["major"], gpu_node["minor"]) == (
        os.major(host.st_rdev),
        os.minor(host.st_rdev),
    )
    started = time.monotonic()
    assert node.state.unprepare([ref]) == {"whole": None}
    print(f"unprepare: {1000 * (time.monotonic() - started):.1f} ms")


def test_nvml_refuses_a_mig_device_on_a_gpu_with_mig_mode_off(
    backend: NvmlBackend, whole_gpu: GpuInfo
) -> None:
    """The MIG manager turns NVML's refusal into a MigError no retry can fix (the
    GPU's MIG mode is an administrator's to change). No MIG device is created."""
    with pytest.raises(MigError) as refused:
        backend.mig().create(MigTarget(whole_gpu.uuid, 0, (0, 8), 7))
    print(f"{whole_gpu.uuid}: {refused.value.code}")
    assert refused.value.code in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT")
    assert not refused.value.retryable and not refused.value.gpu_gone
