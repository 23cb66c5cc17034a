"""Discovery, events, prepare and the MIG lifecycle on a real GPU (`make test-gpu`)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import PoolOptions, build_pool
from driver.nvml.backend import NvmlBackend
from driver.nvml.mig import MigError, MigTarget
from driver.nvml.types import GpuInfo, Inventory
from driver.state.claims import ClaimRef
from driver.state.prepare import DeviceState

DRIVER = "gpu.example.com"


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


class _Claims:
    def __init__(self, node: str) -> None:
        self.node = node
        self.docs: dict[str, dict[str, Any]] = {}

    def add(self, uid: str, device: str) -> ClaimRef:
        self.docs[uid] = {
            "metadata": {"namespace": "default", "name": uid, "uid": uid},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "gpu",
                                "driver": DRIVER,
                                "pool": self.node,
                                "device": device,
                            }
                        ],
                        "config": [],
                    }
                }
            },
        }
        return ClaimRef("default", uid, uid)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.docs[name]


class _Healthy:
    def failure(self, device_name: str) -> str | None:
        return None

    def ensure_tainted(self, device_name: str) -> None:
        raise AssertionError("no failed device in this test")


class _NoReports:
    def permanent_failure(self, claim: dict[str, Any], error: Any) -> None:
        raise AssertionError(str(error))


def _state(
    backend: NvmlBackend, inventory: Inventory, tmp_path: Path, **options: Any
) -> tuple[DeviceState, _Claims]:
    claims = _Claims("gpu-node")
    state = DeviceState(
        **options,
        driver_name=DRIVER,
        node_name="gpu-node",
        devices={},
        cdi_root=tmp_path / "cdi",
        data_dir=tmp_path / "plugin",
        claims=claims,
        health=_Healthy(),
        reporter=_NoReports(),
        real_devices=True,
        mig=backend.mig(),
    )
    state.recover()
    pool = build_pool(inventory, PoolOptions(), owned_mig=state.owned_mig())
    state.devices = {d.name: d for d in pool.devices}
    return state, claims


def _nodes_exist(spec: dict[str, Any]) -> None:
    paths = [n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
    paths += [n["path"] for n in spec["containerEdits"].get("deviceNodes", [])]
    missing = [p for p in paths if not os.path.exists(p)]
    assert not missing, f"device nodes missing on the host: {missing}"


def _mig_off(inventory: Inventory) -> list[GpuInfo]:
    return [g for g in inventory.gpus if not g.mig_enabled]


def _mig_on(inventory: Inventory) -> list[GpuInfo]:
    return [g for g in inventory.gpus if g.mig_enabled and g.partition_profiles]


def test_prepare_of_a_gpu_yields_a_spec_whose_device_nodes_exist(
    backend: NvmlBackend, inventory: Inventory, tmp_path: Path
) -> None:
    state, claims = _state(backend, inventory, tmp_path)
    gpu = inventory.gpus[0]
    ref = claims.add("whole", f"gpu-{gpu.minor}")
    started = time.monotonic()
    result = state.prepare([ref])["whole"]
    print(f"prepare of gpu-{gpu.minor}: {1000 * (time.monotonic() - started):.1f} ms")
    assert result.ok, result.error
    spec = state.cdi.read_claim_spec("whole")
    assert spec is not None
    _nodes_exist(spec)
    edits = spec["devices"][0]["containerEdits"]
    assert edits["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"
    node = edits["deviceNodes"][0]
    host = os.stat(node["path"])
    assert (node["major"], node["minor"]) == (os.major(host.st_rdev), os.minor(host.st_rdev))
    started = time.monotonic()
    assert state.unprepare([ref]) == {"whole": None}
    print(f"unprepare: {1000 * (time.monotonic() - started):.1f} ms")


def test_mig_lifecycle_where_mig_mode_is_on(backend: NvmlBackend, inventory: Inventory) -> None:
    """With MIG on: create, list, destroy a MIG device on a free placement. With MIG
    off: NVML refuses to create one (NOT_SUPPORTED) and nothing is published as MIG."""
    mig = backend.mig()
    for gpu in _mig_off(inventory):
        with pytest.raises(MigError) as refused:
            mig.create(MigTarget(gpu.uuid, 0, (0, 8), 7))
        assert refused.value.code in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT")
    for gpu in _mig_on(inventory):
        taken = [set(range(m.placement[0], sum(m.placement))) for m in gpu.mig_instances]
        smallest = min(gpu.partition_profiles, key=lambda p: (p.slice_count, p.memory_bytes))
        free = [
            pl
            for pl in smallest.placements
            if not any(set(range(pl[0], pl[0] + pl[1])) & t for t in taken)
        ]
        if not free:
            continue  # every slice is in use by an administrator's MIG devices: leave them
        started = time.monotonic()
        created = mig.create(
            MigTarget(gpu.uuid, smallest.profile_id, free[0], smallest.slice_count)
        )
        print(f"create {smallest.name}@{free[0]}: {1000 * (time.monotonic() - started):.0f} ms")
        try:
            assert created.uuid is not None and created.uuid.startswith("MIG-")
            assert created in mig.instances(gpu.uuid)
        finally:
            started = time.monotonic()
            assert mig.destroy(gpu.uuid, created.gi_id)
            print(f"destroy: {1000 * (time.monotonic() - started):.0f} ms")
        assert created not in mig.instances(gpu.uuid)
