"""An unprepare destroys a MIG device by its recorded ids, as NVIDIA's driver does,
and still checks it is the recorded one: a few NVML calls however many MIG devices
the GPU holds (before: every instance of every profile was listed, 59-81 calls)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from driver.state.journal.checkpoint import Checkpoint
from tests.unit.test_mig_prepare import H100, Node, make_node

ONE_G = [f"gpu-0-mig-1g10gb-{i}" for i in range(7)]
# nvmlInit, GetHandleByUUID, GetGpuInstanceById, GpuInstanceGetInfo, the UUID check
# (GetHandleByUUID of the MIG UUID, GetGpuInstanceId, GetComputeInstanceId),
# GetComputeInstanceById, ComputeInstanceDestroy, GpuInstanceDestroy, nvmlShutdown
DESTROY_BY_ID_CALLS = 11


def _calls(node: Node) -> int:
    return sum(node.backend.nvml_calls.values())


def _unprepare_cost(node: Node, uid: str) -> int:
    before = _calls(node)
    assert node.state.unprepare([node.claims.add(uid)]) == {uid: None}
    return _calls(node) - before


def test_unprepare_of_a_mig_device_costs_a_few_calls_on_a_full_gpu(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    for i, device in enumerate(ONE_G):
        assert node.state.prepare([node.claims.add(f"c{i}", device)])[f"c{i}"].ok
    assert len(node.live()) == 7
    assert _unprepare_cost(node, "c3") <= DESTROY_BY_ID_CALLS
    assert len(node.live()) == 6
    assert _unprepare_cost(node, "c0") <= DESTROY_BY_ID_CALLS
    assert len(node.live()) == 5


def test_unprepare_leaves_an_instance_that_took_over_the_recorded_id(tmp_path: Path) -> None:
    """The recorded GPU-instance id now names another device (the claim's was
    destroyed by a reset and an administrator created one that got the id): the
    check of profile and placement keeps it."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", ONE_G[0])])["u"].ok
    (mine,) = node.live()
    journal = Checkpoint(node.root / "plugin").load()
    (device,) = journal["u"].devices
    assert device.mig is not None
    moved = replace(device.mig, placement=(device.mig.placement[0] + 1, 1))
    journal["u"] = replace(journal["u"], devices=(replace(device, mig=moved),))
    Checkpoint(node.root / "plugin").store(journal)
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert node.live() == [mine]


def _prepare_cost(node: Node, uid: str, device: str) -> int:
    before = _calls(node)
    assert node.state.prepare([node.claims.add(uid, device)])[uid].ok
    return _calls(node) - before


# The check of what sits at the placement before the create: nvmlInit, GetHandleByUUID,
# GetGpuInstances of the profile, GpuInstanceGetInfo of each, nvmlShutdown. The create:
# nvmlInit, GetHandleByUUID, CreateGpuInstanceWithPlacement, GpuInstanceGetInfo, a
# compute-instance profile per slice count tried, CreateComputeInstance,
# ComputeInstanceGetInfo, GetMaxMigDeviceCount, the MIG devices walked to the new one
# (MigDeviceHandleByIndex, GetGpuInstanceId, GetComputeInstanceId each), GetUUID,
# nvmlShutdown.
def _prepare_bound(instances_of_profile: int, mig_devices: int) -> int:
    return 5 + instances_of_profile + 10 + 3 * (mig_devices + 1)


def test_prepare_of_a_mig_device_reads_only_its_profile_not_the_whole_gpu(
    tmp_path: Path,
) -> None:
    """Before the create, prepare records what sits at the placement (the crash-safety
    `before` ids). That takes the instances of the device's own profile, not every
    instance of every profile with its compute instances and MIG devices (before: 41
    calls on an empty GPU, more with every device the GPU held)."""
    node = make_node(tmp_path, H100)  # discovery reads the GPU's profiles, once
    assert _prepare_cost(node, "first", ONE_G[0]) <= _prepare_bound(0, 0)
    for i in range(1, 6):
        assert node.state.prepare([node.claims.add(f"c{i}", ONE_G[i])])[f"c{i}"].ok
    assert _prepare_cost(node, "last", ONE_G[6]) <= _prepare_bound(6, 6)
    assert len(node.live()) == 7
