"""The MIG scenarios of the real-GPU tier (tests/gpu/test_mig.py), written against an
NVML backend so that tests/unit/test_gpu_tier_gates.py can run them on the mock too.

Each drives the driver's real path (DeviceState, the MIG manager, NVML) on one GPU
that tests/gpu/gates.py chose, and leaves the GPU as it found it: whatever MIG device
a scenario leaves behind (a failed assertion half-way) is destroyed at its end. None
changes MIG mode; none touches a MIG device that was there before it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from driver.devices.mig_devices import partition_name
from driver.devices.model import MigStrategy
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo
from driver.nvml.mig.mig_manager import MigError, MigTarget
from driver.state.journal.checkpoint import ClaimState
from tests.gpu.crash_child import CRASH_POINTS, GPU_INSTANCE_CREATED
from tests.gpu.gates import disjoint_placements, smallest_profile
from tests.gpu.node import open_node, spec_mig_uuid

REPO = Path(__file__).resolve().parents[2]
# The command that starts tests/gpu/crash_child.py on the host's NVML; its arguments
# (root, claim UID, device, crash point, MIG strategy) are appended.
HOST_CRASH_CHILD = (sys.executable, "-m", "tests.gpu.crash_child")


@contextmanager
def _leaves_the_gpu_as_found(backend: NvmlBackend, gpu_uuid: str) -> Iterator[None]:
    mig = backend.mig()
    before = {m.gi_id for m in mig.instances(gpu_uuid)}
    try:
        yield
    finally:
        for m in mig.instances(gpu_uuid):
            if m.gi_id in before:
                continue
            try:
                mig.destroy(gpu_uuid, m.gi_id)
                print(f"cleanup: destroyed GPU instance {m.gi_id} at {m.placement} on {gpu_uuid}")
            except MigError as err:
                print(f"cleanup: GPU instance {m.gi_id} on {gpu_uuid} is left: {err}")


def _ms(started: float) -> str:
    return f"{1000 * (time.monotonic() - started):.0f} ms"


def prepare_creates_the_device_the_spec_names(
    backend: NvmlBackend, root: Path, gpu: GpuInfo, strategy: MigStrategy
) -> None:
    """A dynamic GPU (`strategy`: tests/gpu/gates.py): a claim's partition is created
    at prepare at its placement, the CDI spec names the MIG device NVML lists there,
    and unprepare destroys it."""
    with _leaves_the_gpu_as_found(backend, gpu.uuid):
        node = open_node(backend, root, strategy)
        assert node.pool.mig_modes[gpu.uuid] == "dynamic"
        assert node.live(gpu.uuid) == []
        profile = smallest_profile(gpu)
        (placement,) = disjoint_placements(profile, 1)
        device = partition_name(gpu, profile, placement[0])
        ref = node.claims.add("mig", device)

        started = time.monotonic()
        result = node.state.prepare([ref])["mig"]
        print(f"prepare of {device}: {_ms(started)}")
        assert result.ok, result.error
        (live,) = node.live(gpu.uuid)
        assert (live.placement, live.profile_id) == (placement, profile.profile_id)
        assert live.ci_id is not None and live.uuid is not None and live.uuid.startswith("MIG-")
        assert spec_mig_uuid(node.spec("mig"), "mig", device) == live.uuid
        record = result.devices[0].mig
        assert record is not None and record.owned
        assert (record.gi_id, record.ci_id, record.uuid) == (live.gi_id, live.ci_id, live.uuid)

        started = time.monotonic()
        assert node.state.unprepare([ref]) == {"mig": None}
        print(f"unprepare: {_ms(started)}")
        assert node.live(gpu.uuid) == []
        assert node.state.cdi.read_claim_spec("mig") is None


def crash_then_recover(
    backend: NvmlBackend,
    root: Path,
    gpu: GpuInfo,
    crash_point: str,
    strategy: MigStrategy,
    child: Sequence[str] = HOST_CRASH_CHILD,
) -> None:
    """A prepare killed at `crash_point` (tests/gpu/crash_child.py), beside another
    claim's MIG device and one created behind the driver's back after the crash (an
    administrator's): the restart's recovery destroys exactly what the killed attempt
    created, the journal keeps the other claim only, and the restarted node, now
    `auto` with a foreign device, publishes that device and never the driver's own."""
    assert crash_point in CRASH_POINTS, crash_point
    with _leaves_the_gpu_as_found(backend, gpu.uuid):
        node = open_node(backend, root, strategy)
        assert node.pool.mig_modes[gpu.uuid] == "dynamic"
        assert node.live(gpu.uuid) == []
        profile = smallest_profile(gpu)
        kept_at, crash_at, foreign_at = disjoint_placements(profile, 3)
        kept = node.claims.add("kept", partition_name(gpu, profile, kept_at[0]))
        assert node.state.prepare([kept])["kept"].ok

        device = partition_name(gpu, profile, crash_at[0])
        args = [str(root), "crashed", device, crash_point, strategy.value]
        proc = subprocess.run(
            [*child, *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == -9, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        left = [m for m in node.live(gpu.uuid) if m.placement == crash_at]
        print(f"after the kill at {crash_point}, at {crash_at}: {left}")
        if crash_point == "prepare-before-mig-create":
            assert left == []
        elif crash_point == GPU_INSTANCE_CREATED:
            assert [(m.ci_id, m.uuid) for m in left] == [(None, None)]
        else:
            assert len(left) == 1 and left[0].uuid is not None
        assert node.state.checkpoint.load()["crashed"].state is ClaimState.PREPARE_STARTED

        target = MigTarget(gpu.uuid, profile.profile_id, foreign_at, profile.slice_count)
        foreign = backend.mig().create(target)
        neighbours = [m for m in node.live(gpu.uuid) if m.placement != crash_at]

        started = time.monotonic()
        restarted = open_node(backend, root, MigStrategy.AUTO)
        print(f"restart (recovery, discovery): {_ms(started)}")
        assert restarted.recovered.rolled_back == ("crashed",)
        assert restarted.recovered.problems == ()
        assert restarted.live(gpu.uuid) == neighbours
        assert set(restarted.state.checkpoint.load()) == {"kept"}
        assert restarted.state.cdi.read_claim_spec("crashed") is None
        assert restarted.pool.mig_modes[gpu.uuid] == "static"
        assert restarted.published_uuids(gpu.uuid) == {foreign.uuid}

        assert restarted.state.unprepare([kept]) == {"kept": None}
        assert restarted.live(gpu.uuid) == [foreign]
        assert backend.mig().destroy(gpu.uuid, foreign.gi_id)


def static_devices_are_prepared_as_they_are(backend: NvmlBackend, root: Path, gpu: GpuInfo) -> None:
    """A GPU with an administrator's MIG devices (`auto` turns it static): exactly
    those with a compute instance and a known profile are published; a claim on one
    gets its UUID in the CDI spec; unprepare leaves every MIG device as it was."""
    with _leaves_the_gpu_as_found(backend, gpu.uuid):
        _prepare_a_static_device(backend, root, gpu)


def _prepare_a_static_device(backend: NvmlBackend, root: Path, gpu: GpuInfo) -> None:
    node = open_node(backend, root, MigStrategy.AUTO)
    assert node.pool.mig_modes[gpu.uuid] == "static"
    before = node.live(gpu.uuid)
    known = {p.profile_id for p in gpu.partition_profiles}
    listed = {m.uuid for m in before if m.uuid is not None and m.profile_id in known}
    assert listed, f"{gpu.uuid}: no MIG device of a profile discovery reports: {before}"
    assert node.published_uuids(gpu.uuid) == listed
    device = next(d for d in node.pool.devices_of_gpu(gpu.uuid) if d.mig is not None)
    uuid = device.document["attributes"]["uuid"]["string"]
    ref = node.claims.add("static", device.name)

    result = node.state.prepare([ref])["static"]
    assert result.ok, result.error
    record = result.devices[0].mig
    assert record is not None and not record.owned and record.uuid == uuid
    assert spec_mig_uuid(node.spec("static"), "static", device.name) == uuid
    assert node.state.unprepare([ref]) == {"static": None}
    assert node.live(gpu.uuid) == before
