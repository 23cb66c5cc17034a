"""The mock NVML's MIG lifecycle: GPU/compute instances, MIG devices, shared state, files."""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from driver.nvml.mock import mock_api as m
from driver.nvml.mock.fleet import FleetError, parse_fleet
from driver.nvml.mock.mig import mig_state as ms
from driver.nvml.mock.nvml import MockNvml

MIG_UUID = re.compile(r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
STATIC = [{"profile": "1g.10gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]


def _fleet(**h100: Any) -> Any:
    return parse_fleet(
        {
            "gpus": [
                {"model": "H100-80GB", "count": 2, **h100},
                {"model": "A100-40GB", "count": 1},
                {"model": "A100-80GB", "migMode": "disabled"},
                {"model": "example"},
            ]
        }
    )


def _nvml(driver_root: Path | None = None, **h100: Any) -> MockNvml:
    nvml = MockNvml(_fleet(**h100), "node-a", driver_root=driver_root)
    nvml.nvmlInit()
    return nvml


@pytest.fixture
def nvml() -> MockNvml:
    return _nvml()


def _code(call: Callable[[], object]) -> int:
    with pytest.raises(m.NVMLError) as err:
        call()
    return int(err.value.value)


def _placement(start: int, size: int) -> m.c_nvmlGpuInstancePlacement_t:
    p = m.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return p


def _gi_at(nvml: MockNvml, gpu: int, profile_id: int, start: int, size: int) -> Any:
    dev = nvml.nvmlDeviceGetHandleByIndex(gpu)
    placement = ctypes.byref(_placement(start, size))
    return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile_id, placement)


def _full_ci(nvml: MockNvml, gi: Any, slot: int) -> Any:
    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, slot, m.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    return nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)


def _mig_handles(nvml: MockNvml, gpu: int) -> list[Any]:
    dev = nvml.nvmlDeviceGetHandleByIndex(gpu)
    found = []
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(dev)):
        try:
            found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(dev, i))
        except m.NVMLError as err:
            assert err.value == m.NVML_ERROR_NOT_FOUND
    return found


# --------------------------------------------------------------------------- GPU instances


def test_create_at_placement_and_read_back(nvml: MockNvml) -> None:
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = _gi_at(nvml, 0, 9, 4, 4)  # 3g.40gb in the upper half: swizzle ID 2
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.id, info.profileId, info.placement.start, info.placement.size) == (2, 9, 4, 4)
    assert info.device is dev
    assert nvml.nvmlDeviceGetGpuInstanceById(dev, 2) == gi
    ci = _full_ci(nvml, gi, m.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    ci_info = nvml.nvmlComputeInstanceGetInfo(ci)
    assert (ci_info.id, ci_info.profileId) == (0, m.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    assert (ci_info.placement.start, ci_info.placement.size) == (0, 3)
    assert ci_info.device is dev  # nvml.h: the parent device, not the MIG device
    assert ci_info.gpuInstance == gi
    assert nvml.nvmlComputeInstanceGetInfo_v2(ci) == ci_info
    [mig] = _mig_handles(nvml, 0)
    uuid = nvml.nvmlDeviceGetUUID(mig)
    assert MIG_UUID.fullmatch(uuid)
    assert nvml.nvmlDeviceGetHandleByUUID(uuid) is mig
    assert nvml.nvmlDeviceGetHandleByUUID(f"MIG-{nvml.gpus[0].uuid}/2/0".encode()) is mig
    assert bool(nvml.nvmlDeviceIsMigDeviceHandle(mig)) and not nvml.nvmlDeviceIsMigDeviceHandle(dev)
    assert isinstance(nvml.nvmlDeviceIsMigDeviceHandle(mig), ctypes.c_uint)  # as pynvml
    assert nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) is dev
    assert (nvml.nvmlDeviceGetGpuInstanceId(mig), nvml.nvmlDeviceGetComputeInstanceId(mig)) == (
        2,
        0,
    )
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 40448 * 2**20
    assert nvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert nvml.nvmlDeviceGetCudaComputeCapability(mig) == (9, 0)
    assert _code(lambda: nvml.nvmlDeviceGetMinorNumber(mig)) == m.NVML_ERROR_NOT_SUPPORTED
    assert _code(lambda: nvml.nvmlDeviceGetMigMode(mig)) == m.NVML_ERROR_NOT_SUPPORTED
    assert _code(lambda: nvml.nvmlDeviceGetSupportedEventTypes(mig)) == m.NVML_ERROR_NOT_SUPPORTED
    assert _code(lambda: nvml.nvmlDeviceGetGpuInstanceId(dev)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert nvml.nvmlDeviceGetMemoryInfo(dev).total == 81559 * 2**20  # the GPU is unchanged


def test_gpu_instance_ids_are_swizzle_ids_and_default_placement_is_best_fit() -> None:
    nvml = _nvml()
    a100 = nvml.nvmlDeviceGetHandleByIndex(2)
    # Published A100 transcripts: seven `nvidia-smi mig -cgi 19` give these GI IDs.
    gis = [nvml.nvmlDeviceCreateGpuInstance(a100, 19) for _ in range(7)]
    infos = [nvml.nvmlGpuInstanceGetInfo(gi) for gi in gis]
    assert [i.id for i in infos] == [13, 11, 12, 7, 8, 9, 10]
    assert [i.placement.start for i in infos] == [6, 4, 5, 0, 1, 2, 3]
    assert _code(lambda: nvml.nvmlDeviceCreateGpuInstance(a100, 19)) == (
        m.NVML_ERROR_INSUFFICIENT_RESOURCES
    )
    for gi in gis:
        nvml.nvmlGpuInstanceDestroy(gi)
    halves = [nvml.nvmlDeviceCreateGpuInstance(a100, 9) for _ in range(2)]
    assert [nvml.nvmlGpuInstanceGetInfo(gi).id for gi in halves] == [2, 1]
    nvml.nvmlGpuInstanceDestroy(halves[0])
    assert nvml.nvmlGpuInstanceGetInfo(_gi_at(nvml, 2, 14, 4, 2)).id == 5  # quarters: 3-6
    assert nvml.nvmlGpuInstanceGetInfo(_gi_at(nvml, 0, 0, 0, 8)).id == 0


def test_occupied_and_overlapping_placements_are_insufficient_resources(nvml: MockNvml) -> None:
    _gi_at(nvml, 0, 19, 4, 1)
    occupied = _code(lambda: _gi_at(nvml, 0, 19, 4, 1))
    overlapping = _code(lambda: _gi_at(nvml, 0, 9, 4, 4))
    assert occupied == overlapping == m.NVML_ERROR_INSUFFICIENT_RESOURCES
    _gi_at(nvml, 0, 20, 0, 1)  # 1g.10gb+me: one per GPU
    assert _code(lambda: _gi_at(nvml, 0, 20, 1, 1)) == m.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert nvml.nvmlGpuInstanceGetInfo(_gi_at(nvml, 0, 14, 2, 2)).id == 4  # the gap still fits
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    assert _code(lambda: nvml.nvmlDeviceCreateGpuInstance(dev, 9)) == (  # no free half
        m.NVML_ERROR_INSUFFICIENT_RESOURCES
    )


def test_bad_placement_profile_and_mig_off(nvml: MockNvml) -> None:
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    assert _code(lambda: _gi_at(nvml, 0, 9, 2, 4)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: _gi_at(nvml, 0, 19, 7, 1)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: _gi_at(nvml, 0, 19, 0, 2)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: nvml.nvmlDeviceCreateGpuInstance(dev, 99)) == (
        m.NVML_ERROR_INVALID_ARGUMENT
    )
    bad = nvml.nvmlDeviceCreateGpuInstanceWithPlacement
    assert _code(lambda: bad(dev, 19, object())) == m.NVML_ERROR_INVALID_ARGUMENT
    off = nvml.nvmlDeviceGetHandleByIndex(3)  # A100-80GB, migMode: disabled
    example = nvml.nvmlDeviceGetHandleByIndex(4)
    listed = ctypes.c_uint(5)
    count = ctypes.byref(listed)
    creates: list[Callable[[Any], object]] = [
        lambda h: nvml.nvmlDeviceCreateGpuInstance(h, 19),
        lambda h: nvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, _placement(0, 1)),
    ]
    lookups: list[Callable[[Any], object]] = [
        lambda h: nvml.nvmlDeviceGetGpuInstanceById(h, 7),
        lambda h: nvml.nvmlDeviceGetGpuInstances(h, 19, [], count),
        lambda h: nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0),
    ]
    for call in creates + lookups:
        assert _code(lambda call=call: call(example)) == m.NVML_ERROR_NOT_SUPPORTED
    for call in creates:
        assert _code(lambda call=call: call(off)) == m.NVML_ERROR_NOT_SUPPORTED
    # A MIG-capable GPU with MIG mode off has no instances to find (a real H200 answered
    # so: tests/data/nvml-probe-h200.json).
    assert _code(lambda: nvml.nvmlDeviceGetGpuInstanceById(off, 7)) == m.NVML_ERROR_NOT_FOUND
    assert _code(lambda: nvml.nvmlDeviceGetMigDeviceHandleByIndex(off, 0)) == (
        m.NVML_ERROR_NOT_FOUND
    )
    nvml.nvmlDeviceGetGpuInstances(off, 19, [], count)
    assert listed.value == 0
    for h in (off, example):
        assert nvml.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(dev) == 7


def test_unknown_ids_and_stale_handles(nvml: MockNvml) -> None:
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    assert _code(lambda: nvml.nvmlDeviceGetGpuInstanceById(dev, 3)) == m.NVML_ERROR_NOT_FOUND
    gi = _gi_at(nvml, 0, 14, 2, 2)
    assert _code(lambda: nvml.nvmlGpuInstanceGetComputeInstanceById(gi, 0)) == (
        m.NVML_ERROR_NOT_FOUND
    )
    nvml.nvmlGpuInstanceDestroy(gi)
    again = _gi_at(nvml, 0, 14, 2, 2)  # same ID, new instance
    assert nvml.nvmlGpuInstanceGetInfo(again).id == 4
    assert _code(lambda: nvml.nvmlGpuInstanceGetInfo(gi)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: nvml.nvmlGpuInstanceDestroy(gi)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: nvml.nvmlGpuInstanceGetInfo(dev)) == m.NVML_ERROR_INVALID_ARGUMENT


# --------------------------------------------------------------------------- compute instances


def test_destroy_gpu_instance_with_compute_instance_is_in_use(nvml: MockNvml) -> None:
    gi = _gi_at(nvml, 0, 19, 3, 1)
    ci = _full_ci(nvml, gi, m.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    assert _code(lambda: nvml.nvmlGpuInstanceDestroy(gi)) == m.NVML_ERROR_IN_USE
    assert nvml.nvmlGpuInstanceGetInfo(gi).id == 10  # still there
    [mig] = _mig_handles(nvml, 0)
    nvml.nvmlComputeInstanceDestroy(ci)  # CI first, then GI
    assert _code(lambda: nvml.nvmlComputeInstanceGetInfo(ci)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: nvml.nvmlDeviceGetUUID(mig)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _mig_handles(nvml, 0) == []
    nvml.nvmlGpuInstanceDestroy(gi)
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    assert _code(lambda: nvml.nvmlDeviceGetGpuInstanceById(dev, 10)) == m.NVML_ERROR_NOT_FOUND


@pytest.mark.parametrize(
    ("profile_id", "gi_slot", "ci_slot", "name", "sms"),
    [
        (0, "7_SLICE", "7_SLICE", "7g.80gb", 132),
        (19, "1_SLICE", "1_SLICE", "1g.10gb", 16),
        (20, "1_SLICE_REV1", "1_SLICE", "1g.10gb+me", 16),
        (15, "1_SLICE_REV2", "1_SLICE", "1g.20gb", 26),
        (9, "3_SLICE", "3_SLICE", "3g.40gb", 60),
    ],
)
def test_the_compute_instance_covering_the_gpu_instance(
    nvml: MockNvml, profile_id: int, gi_slot: str, ci_slot: str, name: str, sms: int
) -> None:
    slot = getattr(m, f"NVML_GPU_INSTANCE_PROFILE_{gi_slot}")
    ci_profile = getattr(m, f"NVML_COMPUTE_INSTANCE_PROFILE_{ci_slot}")
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstance(dev, profile_id)
    gi_info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(dev, slot)
    shared = m.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_profile, shared)
    assert (info.id, info.sliceCount, info.instanceCount) == (ci_profile, gi_info.sliceCount, 1)
    assert (info.name, info.multiprocessorCount) == (f"MIG {name}", sms)
    assert info.version == m.nvmlComputeInstanceProfileInfo_v2
    assert (info.sharedCopyEngineCount, info.sharedDecoderCount, info.sharedOfaCount) == (
        gi_info.copyEngineCount,
        gi_info.decoderCount,
        gi_info.ofaCount,
    )
    v1 = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_profile, shared, version=1)
    assert (v1.version, v1.name, v1.id) == (0, "", ci_profile)
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    [mig] = _mig_handles(nvml, 0)
    assert nvml.nvmlDeviceGetName(mig).endswith(f"MIG {name}")
    assert nvml.nvmlDeviceGetMemoryInfo(mig).total == gi_info.memorySizeMB * 2**20
    assert nvml.nvmlGpuInstanceGetComputeInstanceById(gi, 0) == ci
    assert _code(lambda: nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)) == (
        m.NVML_ERROR_INSUFFICIENT_RESOURCES
    )


def test_compute_instance_profiles_of_a_7g_instance(nvml: MockNvml) -> None:
    gi = _gi_at(nvml, 0, 0, 0, 8)
    shared = m.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo
    table = {}
    for slot in range(m.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            p = info(gi, slot, shared)
        except m.NVMLError as err:
            assert err.value == m.NVML_ERROR_NOT_SUPPORTED, slot
            continue
        table[p.name] = (p.sliceCount, p.instanceCount, p.multiprocessorCount)
    assert table == {
        "MIG 1c.7g.80gb": (1, 7, 16),
        "MIG 2c.7g.80gb": (2, 3, 32),
        "MIG 3c.7g.80gb": (3, 2, 60),
        "MIG 4c.7g.80gb": (4, 1, 64),
        "MIG 7g.80gb": (7, 1, 132),
    }
    count = m.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    assert _code(lambda: info(gi, count, shared)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: info(gi, 0, 1)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: info(gi, 0, shared, version=3)) == m.NVML_ERROR_FUNCTION_NOT_FOUND
    # Partial compute instances: IDs 0, 1, ...; the full one no longer fits.
    three = info(gi, m.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, shared).id
    a = nvml.nvmlGpuInstanceCreateComputeInstance(gi, three)
    b = nvml.nvmlGpuInstanceCreateComputeInstance(gi, three)
    placements = [nvml.nvmlComputeInstanceGetInfo(ci).placement for ci in (a, b)]
    assert [(p.start, p.size) for p in placements] == [(0, 3), (4, 3)]
    assert [nvml.nvmlComputeInstanceGetInfo(ci).id for ci in (a, b)] == [0, 1]
    full = m.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE
    assert _code(lambda: nvml.nvmlGpuInstanceCreateComputeInstance(gi, full)) == (
        m.NVML_ERROR_INSUFFICIENT_RESOURCES
    )
    migs = _mig_handles(nvml, 0)
    assert [nvml.nvmlDeviceGetComputeInstanceId(h) for h in migs] == [0, 1]
    assert nvml.nvmlDeviceGetName(migs[1]) == "NVIDIA H100 80GB HBM3 MIG 3c.7g.80gb"
    assert len({nvml.nvmlDeviceGetUUID(h) for h in migs}) == 2


def test_listing_into_ctypes_arrays_as_pynvml_callers_do(nvml: MockNvml) -> None:
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    for start in (0, 2):
        gi = _gi_at(nvml, 0, 14, start, 2)
        _full_ci(nvml, gi, m.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    gis = (MockNvml.c_nvmlGpuInstance_t * 3)()
    count = ctypes.c_uint(3)
    assert nvml.nvmlDeviceGetGpuInstances(dev, 14, gis, ctypes.byref(count)) == m.NVML_SUCCESS
    assert count.value == 2
    assert [nvml.nvmlGpuInstanceGetInfo(gis[i]).id for i in range(2)] == [3, 4]
    cis = (MockNvml.c_nvmlComputeInstance_t * 1)()
    ci_count = ctypes.c_uint(1)
    slot = m.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE
    nvml.nvmlGpuInstanceGetComputeInstances(gis[1], slot, cis, ctypes.pointer(ci_count))
    assert ci_count.value == 1
    assert nvml.nvmlComputeInstanceGetInfo(cis[0]).gpuInstance == nvml.nvmlDeviceGetGpuInstanceById(
        dev, 4
    )
    as_list: list[Any] = [None]
    nvml.nvmlDeviceGetGpuInstances(dev, 19, as_list, ctypes.byref(count))
    assert count.value == 0 and as_list == [None]
    small = (MockNvml.c_nvmlGpuInstance_t * 1)()
    call = lambda: nvml.nvmlDeviceGetGpuInstances(dev, 14, small, ctypes.byref(count))  # noqa: E731
    assert _code(call) == m.NVML_ERROR_INSUFFICIENT_SIZE and count.value == 2
    assert _code(lambda: nvml.nvmlGpuInstanceGetInfo(cis[0])) == m.NVML_ERROR_INVALID_ARGUMENT


def test_mig_device_indices_are_dense_and_ordered(nvml: MockNvml) -> None:
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    for profile_id, start, size, slot in ((19, 6, 1, 0), (14, 0, 2, 1), (19, 4, 1, 0)):
        _full_ci(nvml, _gi_at(nvml, 0, profile_id, start, size), slot)
    migs = _mig_handles(nvml, 0)
    assert [nvml.nvmlDeviceGetGpuInstanceId(h) for h in migs] == [3, 11, 13]
    assert _code(lambda: nvml.nvmlDeviceGetMigDeviceHandleByIndex(dev, 3)) == (
        m.NVML_ERROR_NOT_FOUND
    )
    assert _code(lambda: nvml.nvmlDeviceGetMigDeviceHandleByIndex(dev, 7)) == (
        m.NVML_ERROR_INVALID_ARGUMENT
    )
    parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle
    assert _code(lambda: parent(dev)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert _code(lambda: nvml.nvmlDeviceGetHandleByUUID("MIG-0-0-0-0-0")) == m.NVML_ERROR_NOT_FOUND


def test_lost_gpu_answers_gpu_is_lost_for_its_instances(nvml: MockNvml) -> None:
    gi = _gi_at(nvml, 0, 19, 0, 1)
    _full_ci(nvml, gi, 0)
    [mig] = _mig_handles(nvml, 0)
    nvml.inject_gpu_lost(nvml.gpus[0].uuid)
    assert _code(lambda: nvml.nvmlGpuInstanceGetInfo(gi)) == m.NVML_ERROR_GPU_IS_LOST
    assert _code(lambda: nvml.nvmlDeviceGetUUID(mig)) == m.NVML_ERROR_GPU_IS_LOST
    nvml.reset(nvml.gpus[0].uuid)
    assert MIG_UUID.fullmatch(nvml.nvmlDeviceGetUUID(mig))


def test_calls_are_counted_and_need_init() -> None:
    nvml = MockNvml(_fleet(), "node-a")
    assert _code(lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(None)) == m.NVML_ERROR_UNINITIALIZED
    nvml.nvmlInit()
    gi = _gi_at(nvml, 0, 19, 0, 1)
    nvml.nvmlComputeInstanceGetInfo(_full_ci(nvml, gi, 0))
    assert nvml.calls["nvmlDeviceCreateGpuInstanceWithPlacement"] == 1
    assert nvml.calls["nvmlGpuInstanceCreateComputeInstance"] == 1
    assert nvml.calls["nvmlComputeInstanceGetInfo_v2"] == 1


# --------------------------------------------------------------------------- static, state, reboot


def test_static_instances_exist_from_the_first_call() -> None:
    nvml = _nvml(migInstances=STATIC)
    for gpu in (0, 1):
        migs = _mig_handles(nvml, gpu)
        assert [nvml.nvmlDeviceGetGpuInstanceId(h) for h in migs] == [2, 7]
        assert [nvml.nvmlDeviceGetName(h)[-7:] for h in migs] == ["3g.40gb", "1g.10gb"]
        assert all(nvml.nvmlDeviceGetComputeInstanceId(h) == 0 for h in migs)
    uuids = [nvml.nvmlDeviceGetUUID(h) for gpu in (0, 1) for h in _mig_handles(nvml, gpu)]
    assert len(set(uuids)) == 4 and all(MIG_UUID.fullmatch(u) for u in uuids)
    again = _nvml(migInstances=STATIC)  # deterministic per node, GPU and instance
    assert [again.nvmlDeviceGetUUID(h) for gpu in (0, 1) for h in _mig_handles(again, gpu)] == uuids
    assert _mig_handles(nvml, 2) == []  # other groups have none


def test_a_device_created_again_at_a_placement_has_the_same_ids_and_a_new_uuid(
    nvml: MockNvml,
) -> None:
    """A GPU instance's id follows its placement and the first compute instance is 0,
    so only the MIG device's UUID tells a device re-created there from the first."""
    first = _full_ci(nvml, _gi_at(nvml, 0, 14, 2, 2), m.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    [mig] = _mig_handles(nvml, 0)
    uuid = nvml.nvmlDeviceGetUUID(mig)
    gi = nvml.nvmlComputeInstanceGetInfo(first).gpuInstance
    nvml.nvmlComputeInstanceDestroy(first)
    nvml.nvmlGpuInstanceDestroy(gi)
    assert _code(lambda: nvml.nvmlDeviceGetHandleByUUID(uuid)) == m.NVML_ERROR_NOT_FOUND
    _full_ci(nvml, _gi_at(nvml, 0, 14, 2, 2), m.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    [again] = _mig_handles(nvml, 0)
    assert (nvml.nvmlDeviceGetGpuInstanceId(again), nvml.nvmlDeviceGetComputeInstanceId(again)) == (
        4,
        0,
    )
    assert nvml.nvmlDeviceGetUUID(again) != uuid
    assert MIG_UUID.fullmatch(nvml.nvmlDeviceGetUUID(again))


def test_reboot_clears_dynamic_and_restores_static() -> None:
    nvml = _nvml(migInstances=STATIC)
    before = [nvml.nvmlDeviceGetUUID(h) for h in _mig_handles(nvml, 0)]
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    _full_ci(nvml, _gi_at(nvml, 0, 14, 2, 2), m.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    static_1g = nvml.nvmlDeviceGetGpuInstanceById(dev, 7)
    ci = nvml.nvmlGpuInstanceGetComputeInstanceById(static_1g, 0)
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(static_1g)
    a100_gi = nvml.nvmlDeviceCreateGpuInstance(nvml.nvmlDeviceGetHandleByIndex(2), 0)
    assert [nvml.nvmlDeviceGetGpuInstanceId(h) for h in _mig_handles(nvml, 0)] == [2, 4]
    nvml.mock_reboot()
    # mig-parted re-creates the layout at boot: the same ids, new MIG devices
    after = _mig_handles(nvml, 0)
    assert [nvml.nvmlDeviceGetGpuInstanceId(h) for h in after] == [2, 7]
    assert not {nvml.nvmlDeviceGetUUID(h) for h in after} & set(before)
    assert _code(lambda: nvml.nvmlGpuInstanceGetInfo(a100_gi)) == m.NVML_ERROR_INVALID_ARGUMENT
    a100 = nvml.nvmlDeviceGetHandleByIndex(2)
    assert _code(lambda: nvml.nvmlDeviceGetGpuInstanceById(a100, 0)) == m.NVML_ERROR_NOT_FOUND
    assert _code(lambda: nvml.nvmlComputeInstanceGetInfo(ci)) == m.NVML_ERROR_INVALID_ARGUMENT


def test_state_is_shared_between_two_mocks_on_one_driver_root(tmp_path: Path) -> None:
    plugin = _nvml(tmp_path, migInstances=STATIC)
    gi = _gi_at(plugin, 0, 14, 2, 2)
    _full_ci(plugin, gi, m.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE)
    restarted = _nvml(tmp_path, migInstances=STATIC)  # a restarted plugin, or a CLI
    migs = _mig_handles(restarted, 0)
    assert [restarted.nvmlDeviceGetGpuInstanceId(h) for h in migs] == [2, 4, 7]
    uuids = [restarted.nvmlDeviceGetUUID(h) for h in migs]
    assert uuids == [plugin.nvmlDeviceGetUUID(h) for h in _mig_handles(plugin, 0)]
    dev = restarted.nvmlDeviceGetHandleByIndex(0)
    theirs = restarted.nvmlDeviceGetGpuInstanceById(dev, 4)
    restarted.nvmlComputeInstanceDestroy(restarted.nvmlGpuInstanceGetComputeInstanceById(theirs, 0))
    restarted.nvmlGpuInstanceDestroy(theirs)
    assert _code(lambda: plugin.nvmlGpuInstanceGetInfo(gi)) == m.NVML_ERROR_INVALID_ARGUMENT
    assert len(_mig_handles(plugin, 0)) == 2
    assert _code(lambda: _gi_at(plugin, 0, 19, 4, 1)) == m.NVML_ERROR_INSUFFICIENT_RESOURCES
    restarted.mock_reboot()  # a reboot is seen by every process on the root
    rebooted = _mig_handles(plugin, 0)
    assert [plugin.nvmlDeviceGetGpuInstanceId(h) for h in rebooted] == [2, 7]
    assert not {plugin.nvmlDeviceGetUUID(h) for h in rebooted} & set(uuids)  # created anew
    state = json.loads((tmp_path / ms.STATE_FILE).read_text())
    assert state["version"] == 1
    gpu0 = state["gpus"][plugin.gpus[0].uuid]
    assert [(g["id"], g["profile"], g["start"], g["size"]) for g in gpu0] == [
        (2, 9, 4, 4),
        (7, 19, 0, 1),
    ]
    assert [c["id"] for g in gpu0 for c in g["cis"]] == [0, 0]
    assert not list((tmp_path / ms.STATE_FILE.parent).glob(".mig-state.json.*"))  # no temp left


def _create_in_child(root: str, start: int, queue: Any) -> None:
    nvml = _nvml(Path(root))
    try:
        _gi_at(nvml, 2, 19, start, 1)
        queue.put(start)
    except m.NVMLError as err:
        queue.put(-int(err.value))


def test_processes_serialize_on_the_state_file(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    children = [
        ctx.Process(target=_create_in_child, args=(str(tmp_path), s % 7, queue)) for s in range(14)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    results = sorted(queue.get(timeout=5) for _ in children)
    assert results.count(-m.NVML_ERROR_INSUFFICIENT_RESOURCES) == 7
    assert sorted(r for r in results if r >= 0) == list(range(7))  # each slot exactly once
    nvml = _nvml(tmp_path)
    a100 = nvml.nvmlDeviceGetHandleByIndex(2)
    count = ctypes.c_uint(7)
    nvml.nvmlDeviceGetGpuInstances(a100, 19, [None] * 7, ctypes.byref(count))
    assert count.value == 7


# --------------------------------------------------------------------------- capability files


def _access(minor: int, mode: int = 292) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def test_capability_files_follow_the_instances(tmp_path: Path) -> None:
    nvml = _nvml(tmp_path)
    caps = tmp_path / "proc/driver/nvidia/capabilities"
    gi = _gi_at(nvml, 1, 9, 0, 4)  # GPU minor 1, GI 1
    assert (caps / "gpu1/mig/gi1/access").read_text() == _access(3 + 135 + 9)
    ci = _full_ci(nvml, gi, m.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    assert (caps / "gpu1/mig/gi1/ci0/access").read_text() == _access(3 + 135 + 9 + 1)
    assert (caps / "mig/config").read_text() == _access(1, 256)
    assert (caps / "mig/monitor").read_text() == _access(2)
    assert sorted(p.name for p in caps.iterdir()) == ["gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "mig"]
    assert not any((caps / "gpu0/mig").iterdir())
    nvml.nvmlComputeInstanceDestroy(ci)
    assert not (caps / "gpu1/mig/gi1/ci0").exists()
    assert (caps / "gpu1/mig/gi1/access").exists()
    nvml.nvmlGpuInstanceDestroy(gi)
    assert not (caps / "gpu1/mig/gi1").exists()


def test_capability_files_of_static_instances_and_reboot(tmp_path: Path) -> None:
    nvml = _nvml(tmp_path, migInstances=STATIC)  # no MIG call yet: the files exist from boot
    caps = tmp_path / "proc/driver/nvidia/capabilities"
    assert (tmp_path / "proc/driver/nvidia-caps/mig-minors").is_file()
    assert (caps / "gpu0/mig/gi7/ci0/access").read_text() == _access(ms.mig_minor(0, 7, 0))
    assert (caps / "gpu1/mig/gi2/access").read_text() == _access(ms.mig_minor(1, 2))
    _gi_at(nvml, 0, 14, 2, 2)
    assert (caps / "gpu0/mig/gi4/access").exists()
    nvml.mock_reboot()
    assert not (caps / "gpu0/mig/gi4").exists()
    assert sorted(p.name for p in (caps / "gpu0/mig").iterdir()) == ["gi2", "gi7"]


def test_mig_minors_file_matches_the_kernel_numbering(tmp_path: Path) -> None:
    nvml = _nvml(tmp_path)
    _gi_at(nvml, 0, 19, 0, 1)
    text = (tmp_path / "proc/driver/nvidia-caps/mig-minors").read_text()
    lines = text.splitlines()
    # nv-caps.c: config 1, monitor 2, then gpu0..31 x gi0..14 x (access, ci0..7).
    assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    assert lines[10:12] == ["gpu0/gi0/ci7/access 11", "gpu0/gi1/access 12"]
    assert lines[-1] == "gpu31/gi14/ci7/access 4322"
    assert len(lines) == 2 + 32 * 15 * 9
    assert ms.mig_minor(0, 0) == 3 and ms.mig_minor(31, 14, 7) == 4322
    with pytest.raises(ValueError):
        ms.mig_minor(32, 0)


def test_in_memory_mode_writes_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    nvml = _nvml(migInstances=STATIC)
    _gi_at(nvml, 0, 14, 2, 2)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- fleet


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (
            {"model": "H100-80GB", "migMode": "disabled", "migInstances": STATIC},
            "gpus[0].migInstances: MIG mode must be enabled",
        ),
        (
            {"model": "example", "migInstances": STATIC},
            "gpus[0].migInstances: MIG mode must be enabled",
        ),
        (
            {"model": "H100-80GB", "migInstances": [{"profile": "1g.5gb", "start": 0}]},
            "gpus[0].migInstances[0].profile: unknown MIG profile '1g.5gb' for model H100-80GB",
        ),
        (
            {"model": "H100-80GB", "migInstances": [*STATIC, {"profile": "3g.40gb", "start": 2}]},
            "gpus[0].migInstances[2].start: 2 is not a possible placement of 3g.40gb",
        ),
        (
            {"model": "H100-80GB", "migInstances": [*STATIC, {"profile": "2g.20gb", "start": 4}]},
            "gpus[0].migInstances[2]: 2g.20gb at 4 overlaps 3g.40gb at 4",
        ),
        (
            {
                "model": "H100-80GB",
                "migInstances": [
                    {"profile": "1g.10gb+me", "start": 0},
                    {"profile": "1g.10gb+me", "start": 1},
                ],
            },
            "gpus[0].migInstances[1]: 1g.10gb+me: at most 1 instance(s) per GPU",
        ),
        (
            {"model": "H100-80GB", "migInstances": [{"profile": "1g.10gb", "start": -1}]},
            "gpus[0].migInstances[0].start: Expected `int` >= 0",
        ),
        (
            {"model": "H100-80GB", "migInstances": [{"profile": "1g.10gb", "placement": 0}]},
            "gpus[0].migInstances[0].placement: unknown field",
        ),
    ],
)
def test_fleet_validation_errors_name_the_field(group: dict[str, Any], message: str) -> None:
    with pytest.raises(FleetError) as err:
        parse_fleet({"gpus": [group]})
    assert message in str(err.value)
