"""The real-GPU tier without a GPU: its skip decisions (tests/gpu/gates.py) fed MIG
modes and MIG-device lists, and its MIG scenarios (tests/gpu/mig_scenarios.py) run
on a mock node in MIG mode. The mock run shows the scenarios' own logic holds; what
a real GPU answers is shown only by `make test-gpu` on one (docs/gpu-testing.md)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import MigStrategy
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo, Inventory, MigInstance, PartitionProfile
from driver.nvml.selection import select_backend
from tests.gpu import mig_scenarios
from tests.gpu.crash_child import CRASH_POINTS, crash_prepare
from tests.gpu.gates import (
    MIG_OFF_HINT,
    Gate,
    TierGates,
    disjoint_placements,
    smallest_profile,
    summary_lines,
)


def _profile(
    name: str, profile_id: int, slices: int, gib: int, starts: Sequence[int]
) -> PartitionProfile:
    size = {1: 1, 2: 2, 3: 4, 4: 4, 7: 8}[slices]
    return PartitionProfile(
        name=name,
        profile_id=profile_id,
        slice_count=slices,
        memory_bytes=gib << 30,
        multiprocessors=16 * slices,
        copy_engines=slices,
        decoders=slices,
        encoders=0,
        jpeg_engines=1,
        ofa_engines=0,
        placements=tuple((s, size) for s in starts),
    )


PROFILES = (
    _profile("1g.10gb+me", 20, 1, 10, range(7)),
    _profile("1g.10gb", 19, 1, 10, range(7)),
    _profile("3g.40gb", 9, 3, 40, (0, 4)),
    _profile("7g.80gb", 0, 7, 80, (0,)),
)


def _gpu(minor: int, *, mig: bool = False, instances: Sequence[MigInstance] = ()) -> GpuInfo:
    uuid = f"GPU-{minor:08d}-0000-0000-0000-000000000000"
    return GpuInfo(
        index=minor,
        minor=minor,
        uuid=uuid,
        product_name="NVIDIA H100 80GB HBM3",
        pci_bus_id=f"0000:{minor:02x}:00.0",
        memory_bytes=80 << 30,
        mig_capable=True,
        mig_enabled=mig,
        partition_profiles=PROFILES if mig else (),
        mig_instances=tuple(replace(m, gpu_uuid=uuid) for m in instances),
    )


ADMIN = MigInstance("", 1, 19, (0, 1), ci_id=0, uuid="MIG-admin")
GI_ONLY = MigInstance("", 2, 19, (1, 1))  # a GPU instance without its compute instance


def _inventory(*gpus: GpuInfo) -> Inventory:
    return Inventory(
        backend="nvml", driver_version="580.95.05", cuda_driver_version="13.0", gpus=gpus
    )


def test_mig_off_skips_every_mig_test_with_one_line_saying_so() -> None:
    gpu = _gpu(0)
    gates = TierGates.of([gpu])
    why = f"MIG mode is off on {gpu.uuid}; {MIG_OFF_HINT}"
    assert gates.dynamic_mig == Gate(None, why) and gates.static_mig == Gate(None, why)
    assert gates.whole_gpu == Gate(gpu)
    lines = summary_lines(_inventory(gpu))
    assert lines[1:] == [f"real-GPU tier: dynamic MIG tests and static MIG test skipped: {why}"]
    assert "MIG=off" in lines[0] and gpu.uuid in lines[0]


def test_mig_on_without_mig_devices_runs_the_dynamic_tests_under_the_dynamic_strategy() -> None:
    gpu = _gpu(0, mig=True)
    gates = TierGates.of([gpu])
    assert gates.dynamic_mig == Gate(gpu) and gates.dynamic_strategy is MigStrategy.DYNAMIC
    assert gates.whole_gpu.gpu is None and "every GPU is in MIG mode" in str(gates.whole_gpu.skip)
    assert gates.static_mig.gpu is None
    assert "has a MIG device an administrator created" in str(gates.static_mig.skip)
    assert len(summary_lines(_inventory(gpu))) == 3  # GPUs, whole-GPU skip, static skip


def test_an_administrators_mig_devices_skip_the_dynamic_tests_naming_them() -> None:
    gpu = _gpu(0, mig=True, instances=[ADMIN, GI_ONLY])
    gates = TierGates.of([gpu])
    assert gates.static_mig == Gate(gpu)
    skip = str(gates.dynamic_mig.skip)
    assert gates.dynamic_mig.gpu is None and gpu.uuid in skip
    assert "GPU instance 1 (1g.10gb at 0+1)" in skip  # profile 19: named as nvidia-smi does
    assert "GPU instance 2 (1g.10gb at 1+1)" in skip


def test_a_gpu_instance_without_a_compute_instance_is_no_static_device() -> None:
    gpu = _gpu(0, mig=True, instances=[GI_ONLY])
    gates = TierGates.of([gpu])
    assert gates.dynamic_mig.gpu is None and "nvidia-smi mig -dgi" in str(gates.dynamic_mig.skip)
    assert gates.static_mig.gpu is None


def test_each_group_gets_its_gpu_on_a_mixed_host() -> None:
    off, admin, empty = _gpu(0), _gpu(1, mig=True, instances=[ADMIN]), _gpu(2, mig=True)
    gates = TierGates.of([off, admin, empty])
    assert (gates.whole_gpu.gpu, gates.dynamic_mig.gpu, gates.static_mig.gpu) == (off, empty, admin)
    # `dynamic` would refuse the node for GPU 1's devices: `auto` keeps GPU 2 dynamic.
    assert gates.dynamic_strategy is MigStrategy.AUTO
    assert summary_lines(_inventory(off, admin, empty))[1:] == []


def test_mig_on_without_profiles_skips_the_mig_tests() -> None:
    gpu = GpuInfo(0, 0, "GPU-x", "NVIDIA H100", "0000:01:00.0", 80 << 30, mig_enabled=True)
    gates = TierGates.of([gpu])
    assert gates.dynamic_mig.skip == gates.static_mig.skip
    assert "NVML reports no GPU-instance profile" in str(gates.dynamic_mig.skip)


def test_without_a_gpu_one_line_says_why() -> None:
    assert summary_lines("NVML reports 0 devices") == [
        "real-GPU tier: every test skipped: no NVIDIA GPU on this host: NVML reports 0 devices"
    ]


def test_a_gate_has_a_gpu_or_a_reason() -> None:
    with pytest.raises(ValueError, match="exactly one of gpu and skip"):
        Gate(None)
    with pytest.raises(ValueError, match="exactly one of gpu and skip"):
        Gate(_gpu(0), "why")


def test_the_smallest_profile_is_a_plain_one_and_placements_are_disjoint() -> None:
    assert smallest_profile(_gpu(0, mig=True)).name == "1g.10gb"
    assert disjoint_placements(PROFILES[1], 3) == [(0, 1), (1, 1), (2, 1)]
    assert disjoint_placements(PROFILES[2], 2) == [(0, 4), (4, 4)]
    with pytest.raises(ValueError, match=r"3g\.40gb: 3 disjoint placements needed, 2"):
        disjoint_placements(PROFILES[2], 3)
    with pytest.raises(ValueError, match="no GPU-instance profile"):
        smallest_profile(_gpu(0))


# --------------------------------------------------------------------------- the mock


def _fleet(path: Path, *, admin_gpu: bool) -> Path:
    gpus: list[dict[str, Any]] = [
        {"model": "H100-80GB", "count": 1, "migMode": "disabled"},
        {"model": "H100-80GB", "count": 1},
    ]
    if admin_gpu:
        instances = [{"profile": "1g.10gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]
        gpus.append({"model": "H100-80GB", "count": 1, "migInstances": instances})
    path.write_text(json.dumps({"gpus": gpus}))  # JSON is YAML
    return path


def _mock_backend(fleet: Path, driver_root: Path) -> NvmlBackend:
    return select_backend(
        mock=True, fleet_path=fleet, node_name="gpu-node", mock_driver_root=driver_root
    )


def mock_crash_child(argv: Sequence[str]) -> None:
    """tests/gpu/crash_child.py on the mock node of `argv[:2]` (fleet, driver root)."""
    fleet, driver_root, root, uid, device, crash_point, strategy = argv
    backend = _mock_backend(Path(fleet), Path(driver_root))
    crash_prepare(backend, Path(root), uid, device, crash_point, MigStrategy(strategy))


_MOCK_CHILD = (
    "import sys; from tests.unit.test_gpu_tier_gates import mock_crash_child; "
    "mock_crash_child(sys.argv[1:])"
)


def _mock_node(tmp_path: Path, *, admin_gpu: bool) -> tuple[NvmlBackend, TierGates, Path, Path]:
    fleet = _fleet(tmp_path / "fleet.yaml", admin_gpu=admin_gpu)
    driver_root = tmp_path / "driver-root"
    backend = _mock_backend(fleet, driver_root)
    return backend, TierGates.of(backend.discover().gpus), fleet, driver_root


def test_the_dynamic_scenario_passes_on_a_mock_mig_gpu(tmp_path: Path) -> None:
    backend, gates, _, _ = _mock_node(tmp_path, admin_gpu=False)
    assert gates.dynamic_mig.gpu is not None and gates.dynamic_mig.gpu.minor == 1
    assert gates.dynamic_strategy is MigStrategy.DYNAMIC
    mig_scenarios.prepare_creates_the_device_the_spec_names(
        backend, tmp_path / "node", gates.dynamic_mig.gpu, gates.dynamic_strategy
    )


@pytest.mark.parametrize("crash_point", CRASH_POINTS)
def test_the_crash_scenario_passes_on_a_mock_mig_gpu(crash_point: str, tmp_path: Path) -> None:
    backend, gates, fleet, driver_root = _mock_node(tmp_path, admin_gpu=False)
    assert gates.dynamic_mig.gpu is not None
    child = (sys.executable, "-c", _MOCK_CHILD, str(fleet), str(driver_root))
    mig_scenarios.crash_then_recover(
        backend,
        tmp_path / "node",
        gates.dynamic_mig.gpu,
        crash_point,
        gates.dynamic_strategy,
        child,
    )
    assert backend.mig().instances(gates.dynamic_mig.gpu.uuid) == []  # left as found


def test_the_static_scenario_passes_beside_a_dynamic_gpu_on_a_mock_node(tmp_path: Path) -> None:
    backend, gates, _, _ = _mock_node(tmp_path, admin_gpu=True)
    assert gates.static_mig.gpu is not None and gates.static_mig.gpu.minor == 2
    before = backend.mig().instances(gates.static_mig.gpu.uuid)
    mig_scenarios.static_devices_are_prepared_as_they_are(
        backend, tmp_path / "node", gates.static_mig.gpu
    )
    assert backend.mig().instances(gates.static_mig.gpu.uuid) == before
    assert gates.dynamic_mig.gpu is not None and gates.dynamic_strategy is MigStrategy.AUTO
    mig_scenarios.prepare_creates_the_device_the_spec_names(
        backend, tmp_path / "dynamic", gates.dynamic_mig.gpu, gates.dynamic_strategy
    )
