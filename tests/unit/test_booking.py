"""The double-booking guard judged from the journal's own hardware record: shares only
of the same multi-allocatable device, whole GPUs against their partitions whatever
the pool publishes today, entries of earlier releases through today's pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import PoolOptions, PublishedDevice, build_pool
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.state.booking import conflict, refuse_double_booking
from driver.state.journal.checkpoint import (
    Checkpoint,
    ClaimEntry,
    ClaimState,
    HardwareRecord,
    MigRecord,
    PreparedDevice,
)
from driver.state.request import ClaimRef
from tests.unit.test_prepare import (
    NODE,
    Env,
    make_claim,
    make_env,
    result,
)

# Two A100-40GB with MIG off: gpu-0 and gpu-1 (or their `--gpu-partitions` devices).
INVENTORY = MockBackend(
    MockNvml(
        parse_fleet({"gpus": [{"model": "A100-40GB", "count": 2, "migMode": "disabled"}]}),
        NODE,
    )
).discover()


def pool(partitions: int = 0, shared: bool = False) -> dict[str, PublishedDevice]:
    options = PoolOptions(gpu_partitions=partitions, allow_multiple_allocations=shared)
    return {d.name: d for d in build_pool(INVENTORY, options).devices}


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path, devices=pool())


def share(uid: str, device: str, share_id: str, memory: str = "10Gi") -> dict[str, Any]:
    consumed = {"memory": memory, "compute": "10"}
    return make_claim(uid, [result(device, shareID=share_id, consumedCapacity=consumed)])


def refused_by(env: Env, ref: ClaimRef, holder: str) -> str:
    err = env.prepare_one(ref).error
    assert err is not None, f"{ref.uid} was prepared beside {holder}"
    assert not err.permanent
    assert f"default/claim-{holder}" in str(err) and holder in str(err), err
    return str(err)


# -- shares ---------------------------------------------------------------------------


def test_shares_of_the_full_gpu_and_of_one_of_its_partitions_overlap(env: Env) -> None:
    """`--gpu-partitions` with multiple allocations: a share of gpu-0-full and one of
    gpu-0-partition-0 are shares of different devices on the same hardware."""
    env.state = env.new_state(devices=pool(partitions=2, shared=True))
    full = env.claims.add(share("uid-f", "gpu-0-full", "s-f", memory="40Gi"))
    part = env.claims.add(share("uid-p", "gpu-0-partition-0", "s-p", memory="20Gi"))
    assert env.prepare_one(full).ok
    refused_by(env, part, "uid-f")
    # The other GPU's partition is free.
    other = env.claims.add(share("uid-o", "gpu-1-partition-0", "s-o"))
    assert env.prepare_one(other).ok


def test_shares_of_a_device_published_without_multiple_allocations_overlap(env: Env) -> None:
    """A shareID on a device that is not multi-allocatable (a stale or forged
    allocation) does not make it shareable: the second "share" is refused."""
    a = env.claims.add(share("uid-a", "gpu-0", "s-a"))
    b = env.claims.add(share("uid-b", "gpu-0", "s-b"))
    assert env.prepare_one(a).ok
    refused_by(env, b, "uid-a")


def test_shares_of_a_mig_device_overlap() -> None:
    """MIG devices are never multi-allocatable: their records say so."""
    mig = MigRecord("GPU-aaaa", 19, 1, (3, 1), owned=True)
    hardware = HardwareRecord("GPU-aaaa", slices=(3, 1))
    held, new = (
        PreparedDevice(
            NODE, "gpu-0-mig-1g5gb-3", ("g",), ("x",), share_id=sid, mig=mig, hardware=hardware
        )
        for sid in ("s-1", "s-2")
    )
    assert conflict(held, new, {}) is not None


def test_two_shares_of_one_multi_allocatable_device_within_capacity_are_prepared(
    env: Env,
) -> None:
    env.state = env.new_state(devices=pool(shared=True))
    a = env.claims.add(share("uid-a", "gpu-0", "s-a", memory="20Gi"))
    b = env.claims.add(share("uid-b", "gpu-0", "s-b", memory="20Gi"))
    out = env.state.prepare([a, b])
    assert out["uid-a"].ok and out["uid-b"].ok, (out["uid-a"].error, out["uid-b"].error)
    c = env.claims.add(share("uid-c", "gpu-0", "s-c", memory="1Gi"))
    assert "memory" in refused_by(env, c, "uid-a")  # 41Gi of 40Gi


def test_a_share_is_only_a_share_of_the_same_hardware(env: Env) -> None:
    """The pool changed from 2 to 4 partitions per GPU: the held share of
    gpu-0-partition-0 (half the GPU) and a new share of gpu-0-partition-0 (a quarter)
    carry the same name but are not the same device."""
    env.state = env.new_state(devices=pool(partitions=2, shared=True))
    a = env.claims.add(share("uid-a", "gpu-0-partition-0", "s-a", memory="5Gi"))
    assert env.prepare_one(a).ok
    env.state = env.new_state(devices=pool(partitions=4, shared=True))
    b = env.claims.add(share("uid-b", "gpu-0-partition-0", "s-b", memory="5Gi"))
    refused_by(env, b, "uid-a")


# -- the record, not today's pool ------------------------------------------------------


def test_a_held_gpu_blocks_its_partitions_after_the_pool_changes(env: Env) -> None:
    """`helm upgrade --set kubeletPlugin.gpuPartitions=2` while a pod holds gpu-0."""
    held = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    assert env.prepare_one(held).ok
    env.state = env.new_state(devices=pool(partitions=2))
    for i, device in enumerate(("gpu-0-partition-0", "gpu-0-partition-1", "gpu-0-full")):
        ref = env.claims.add(make_claim(f"uid-p{i}", [result(device)]))
        refused_by(env, ref, "uid-a")
    other = env.claims.add(make_claim("uid-o", [result("gpu-1-partition-0")]))
    assert env.prepare_one(other).ok


def test_partition_spans_are_compared_across_layouts(env: Env) -> None:
    """A held gpu-0-partition-1 of 2 is the GPU's second half: of 4 partitions,
    partition-2 lies in it, partition-0 does not."""
    env.state = env.new_state(devices=pool(partitions=2))
    held = env.claims.add(make_claim("uid-a", [result("gpu-0-partition-1")]))
    assert env.prepare_one(held).ok
    env.state = env.new_state(devices=pool(partitions=4))
    inside = env.claims.add(make_claim("uid-in", [result("gpu-0-partition-2")]))
    refused_by(env, inside, "uid-a")
    outside = env.claims.add(make_claim("uid-out", [result("gpu-0-partition-0")]))
    assert env.prepare_one(outside).ok


def test_planned_devices_record_their_hardware(env: Env) -> None:
    env.state = env.new_state(devices=pool(partitions=4, shared=True))
    ref = env.claims.add(
        make_claim(
            "uid-a",
            [result("gpu-1-partition-3", "a"), result("gpu-0-full", "b", shareID="s-1")],
        )
    )
    res = env.prepare_one(ref)
    assert res.ok, res.error
    uuid0, uuid1 = (INVENTORY.gpus[i].uuid for i in (0, 1))
    assert [d.hardware for d in env.journal()["uid-a"].devices] == [
        HardwareRecord(uuid1, partition=(3, 4), multi_allocatable=True),
        HardwareRecord(uuid0, multi_allocatable=True),
    ]


# -- entries of earlier releases ------------------------------------------------------


def store_old_entry(env: Env, uid: str, device: str, share_id: str | None = None) -> None:
    """An entry as an earlier release wrote it: no hardware record."""
    held = PreparedDevice(NODE, device, ("gpu",), ("x",), share_id=share_id)
    assert held.hardware is None and "hardware" not in held.to_json()
    Checkpoint(env.data_dir).store(
        {uid: ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", f"claim-{uid}", (held,))}
    )


def test_an_entry_of_an_earlier_release_is_guarded_through_todays_pool(env: Env) -> None:
    env.state = env.new_state(devices=pool(partitions=2))
    store_old_entry(env, "uid-a", "gpu-0-full")
    part = env.claims.add(make_claim("uid-p", [result("gpu-0-partition-0")]))
    refused_by(env, part, "uid-a")
    other = env.claims.add(make_claim("uid-o", [result("gpu-1-partition-0")]))
    assert env.prepare_one(other).ok


def test_a_share_of_an_earlier_release_still_shares(env: Env) -> None:
    env.state = env.new_state(devices=pool(shared=True))
    store_old_entry(env, "uid-a", "gpu-0", share_id="s-a")  # no consumption: all of it
    b = env.claims.add(share("uid-b", "gpu-0", "s-b"))
    assert "memory" in refused_by(env, b, "uid-a")
    store_old_entry(env, "uid-a", "gpu-1", share_id="s-a")
    assert env.prepare_one(b).ok


def test_an_old_entry_whose_device_is_no_longer_published_is_refused(env: Env) -> None:
    """Neither the entry nor today's pool tells where gpu-0-partition-1 was: refuse
    rather than double-book, naming both claims."""
    store_old_entry(env, "uid-a", "gpu-0-partition-1")
    ref = env.claims.add(make_claim("uid-b", [result("gpu-1")]))
    text = refused_by(env, ref, "uid-a")
    assert "gpu-0-partition-1" in text and "uid-b" in text, text


def test_the_guard_ignores_admin_access_and_other_pools() -> None:
    hardware = HardwareRecord("GPU-aaaa")
    held = PreparedDevice(NODE, "gpu-0", ("g",), ("x",), hardware=hardware)
    admin = PreparedDevice(NODE, "gpu-0", ("g",), ("y",), admin_access=True, hardware=hardware)
    elsewhere = PreparedDevice("node-b", "gpu-0", ("g",), ("y",), hardware=hardware)
    unknown = PreparedDevice(NODE, "gpu-9", ("g",), ("y",))
    assert conflict(held, admin, {}) is None and conflict(held, elsewhere, {}) is None
    assert conflict(held, held, {}) is not None
    entries = {"uid-a": ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", "a", (unknown,))}
    refuse_double_booking("uid-b", (admin, elsewhere), entries, {})
