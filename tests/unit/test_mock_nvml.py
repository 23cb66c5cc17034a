"""MockNvml: pynvml-shaped answers, NVML error codes, health injection, call counting."""

from __future__ import annotations

import ctypes
import inspect
import threading
import time

import pytest

from driver.nvml.discovered import HealthEvent
from driver.nvml.mock import mock_api as m
from driver.nvml.mock.fleet import example_fleet, parse_fleet
from driver.nvml.mock.nvml import MockNvml


@pytest.fixture
def nvml() -> MockNvml:
    fleet = parse_fleet(
        {"gpus": [{"model": "H100-80GB", "count": 2}, {"model": "example", "count": 1}]}
    )
    mock = MockNvml(fleet, "node-a")
    mock.nvmlInit()
    return mock


def test_calls_require_init_and_are_counted() -> None:
    mock = MockNvml(example_fleet(), "n")
    assert mock.calls.total() == 0
    with pytest.raises(m.NVMLError) as err:
        mock.nvmlDeviceGetCount()
    assert err.value.value == m.NVML_ERROR_UNINITIALIZED
    assert isinstance(err.value, mock.NVMLError_Uninitialized)
    mock.nvmlInit()
    assert mock.nvmlDeviceGetCount() == 8
    mock.nvmlShutdown()
    assert mock.calls == {"nvmlDeviceGetCount": 2, "nvmlInit": 1, "nvmlShutdown": 1}
    assert mock.calls.total() == 4


def test_error_classes_mirror_pynvml() -> None:
    err = m.NVMLError(m.NVML_ERROR_NOT_SUPPORTED)
    assert type(err).__name__ == "NVMLError_NotSupported"
    assert isinstance(err, m.NVMLError)
    assert err.value == 3 and str(err) == "Not Supported"
    assert type(m.NVMLError(m.NVML_ERROR_GPU_IS_LOST)).__name__ == "NVMLError_GpuIsLost"
    assert m.ERROR_CLASSES["NVMLError_Timeout"](10).value == 10
    assert m.NVMLError(12345).value == 12345 and type(m.NVMLError(12345)) is m.NVMLError


def test_system_queries(nvml: MockNvml) -> None:
    assert nvml.nvmlSystemGetDriverVersion() == "580.95.05"
    assert nvml.nvmlSystemGetCudaDriverVersion() == 13000
    assert nvml.nvmlDeviceGetCount() == 3


def test_device_queries(nvml: MockNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(1)
    uuid = nvml.nvmlDeviceGetUUID(h)
    assert nvml.nvmlDeviceGetHandleByUUID(uuid) is h
    assert nvml.nvmlDeviceGetHandleByUUID(uuid.encode()) is h
    assert nvml.nvmlDeviceGetMinorNumber(h) == 1
    assert nvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert nvml.nvmlDeviceGetBrand(h) == m.NVML_BRAND_NVIDIA
    assert nvml.nvmlDeviceGetArchitecture(h) == m.NVML_DEVICE_ARCH_HOPPER
    assert nvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    assert mem.total == 81559 * 2**20 and mem.free + mem.used == mem.total
    mem2 = nvml.nvmlDeviceGetMemoryInfo(h, version=m.nvmlMemory_v2)
    assert mem2.version == m.nvmlMemory_v2 and mem2.reserved > 0
    pci = nvml.nvmlDeviceGetPciInfo(h)
    assert pci.busId == "00000000:2A:00.0" and pci.busIdLegacy == "0000:2A:00.0"
    assert pci.bus == 0x2A and pci.pciDeviceId == 0x233010DE
    assert nvml.nvmlDeviceGetMigMode(h) == [m.NVML_DEVICE_MIG_ENABLE, m.NVML_DEVICE_MIG_ENABLE]


def test_bad_handles_and_unknown_uuids(nvml: MockNvml) -> None:
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetHandleByIndex(3)
    assert err.value.value == m.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetHandleByUUID("GPU-nope")
    assert err.value.value == m.NVML_ERROR_NOT_FOUND
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetUUID(object())
    assert err.value.value == m.NVML_ERROR_INVALID_ARGUMENT


def test_example_gpu_answers_not_supported(nvml: MockNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(2)
    assert nvml.nvmlDeviceGetName(h) == "LATEST-GPU-MODEL"
    assert nvml.nvmlDeviceGetMemoryInfo(h).total == 80 * 2**30
    for fn in (
        nvml.nvmlDeviceGetBrand,
        nvml.nvmlDeviceGetArchitecture,
        nvml.nvmlDeviceGetCudaComputeCapability,
        nvml.nvmlDeviceGetMigMode,
    ):
        with pytest.raises(m.NVMLError) as err:
            fn(h)
        assert err.value.value == m.NVML_ERROR_NOT_SUPPORTED, fn.__name__
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, m.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert err.value.value == m.NVML_ERROR_NOT_SUPPORTED


def test_gpu_instance_profile_info(nvml: MockNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, m.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    assert (info.id, info.name, info.memorySizeMB, info.multiprocessorCount) == (
        19,
        "MIG 1g.10gb",
        9984,
        16,
    )
    assert info.version == m.nvmlGpuInstanceProfileInfo_v2
    me = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, m.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1)
    assert (me.id, me.name, me.ofaCount) == (20, "MIG 1g.10gb+me", 1)
    v1 = nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, m.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 1)
    assert v1.id == 0 and v1.memorySizeMB == 81152
    with pytest.raises(m.NVMLError) as err:  # not a profile of this GPU
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, m.NVML_GPU_INSTANCE_PROFILE_8_SLICE)
    assert err.value.value == m.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, m.NVML_GPU_INSTANCE_PROFILE_COUNT)
    assert err.value.value == m.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetGpuInstanceProfileInfo(h, 0, version=3)
    assert err.value.value == m.NVML_ERROR_FUNCTION_NOT_FOUND


@pytest.mark.parametrize(
    ("driver", "answer"),
    [("580.159.04", m.NVML_ERROR_INVALID_ARGUMENT), ("600.10", m.NVML_ERROR_NOT_SUPPORTED)],
)
def test_a_profile_slot_newer_than_the_driver_is_an_invalid_argument(
    driver: str, answer: int
) -> None:
    """3_SLICE_GFX (0x11) came after R590: an R580 H200 answered INVALID_ARGUMENT for it
    (tests/data/nvml-probe-h200.json); a newer driver knows the slot, which this GPU does
    not have."""
    fleet = parse_fleet({"gpus": [{"model": "H200-141GB", "count": 1}], "driverVersion": driver})
    mock = MockNvml(fleet, "node-a")
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(m.NVMLError) as err:
        mock.nvmlDeviceGetGpuInstanceProfileInfo(handle, m.NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX)
    assert err.value.value == answer


def test_possible_placements_byref_and_pointer(nvml: MockNvml) -> None:
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    assert nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, None, ctypes.byref(count)) == 0
    assert count.value == 4
    array = (m.c_nvmlGpuInstancePlacement_t * 4)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, array, ctypes.pointer(count))
    assert [(p.start, p.size) for p in array] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    small = ctypes.c_uint(2)
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 15, array, ctypes.byref(small))
    assert err.value.value == m.NVML_ERROR_INSUFFICIENT_SIZE and small.value == 4
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, 99, None, ctypes.byref(count))
    assert err.value.value == m.NVML_ERROR_INVALID_ARGUMENT


def _event_set(nvml: MockNvml) -> m.MockEventSet:
    es = nvml.nvmlEventSetCreate()
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlDeviceGetSupportedEventTypes(h), es)
    return es


def test_wait_times_out(nvml: MockNvml) -> None:
    es = _event_set(nvml)
    t0 = time.monotonic()
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlEventSetWait_v2(es, 50)
    assert err.value.value == m.NVML_ERROR_TIMEOUT
    assert time.monotonic() - t0 >= 0.045


def test_injected_xid_and_ecc_are_returned_in_order(nvml: MockNvml) -> None:
    es = _event_set(nvml)
    uuid = nvml.gpus[1].uuid
    nvml.inject_xid(uuid, 79)
    nvml.inject(HealthEvent(gpu_uuid=uuid, kind="ecc-dbe"))
    first = nvml.nvmlEventSetWait_v2(es, 0)
    assert first.eventType == m.nvmlEventTypeXidCriticalError and first.eventData == 79
    assert nvml.nvmlDeviceGetUUID(first.device) == uuid
    second = nvml.nvmlEventSetWait(es, 0)
    assert second.eventType == m.nvmlEventTypeDoubleBitEccError
    with pytest.raises(m.NVMLError):
        nvml.nvmlEventSetWait_v2(es, 0)


def test_events_reach_only_sets_registered_for_the_device(nvml: MockNvml) -> None:
    es = nvml.nvmlEventSetCreate()
    h0 = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceRegisterEvents(h0, m.nvmlEventTypeXidCriticalError, es)
    nvml.inject_xid(nvml.gpus[1].uuid, 48)  # GPU 1 is not registered
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlEventSetWait_v2(es, 0)
    assert err.value.value == m.NVML_ERROR_TIMEOUT
    es2 = _event_set(nvml)
    assert nvml.nvmlEventSetWait_v2(es2, 0).eventData == 48


def test_gpu_lost_until_reset(nvml: MockNvml) -> None:
    es = _event_set(nvml)
    uuid = nvml.gpus[0].uuid
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.inject_gpu_lost(uuid)
    assert nvml.is_lost(uuid)
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlEventSetWait_v2(es, 0)
    assert err.value.value == m.NVML_ERROR_GPU_IS_LOST
    for fn in (nvml.nvmlDeviceGetUUID, nvml.nvmlDeviceGetName, nvml.nvmlDeviceGetMemoryInfo):
        with pytest.raises(m.NVMLError) as err:
            fn(h)
        assert err.value.value == m.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(m.NVMLError):
        nvml.nvmlDeviceGetHandleByUUID(uuid)
    assert nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(1))  # others unaffected
    nvml.reset(uuid)
    assert not nvml.is_lost(uuid)
    assert nvml.nvmlDeviceGetUUID(h) == uuid
    recovered = nvml.nvmlEventSetWait_v2(es, 0)
    assert recovered.eventType == m.nvmlEventTypeGpuRecoveryAction
    assert recovered.eventData == m.NVML_GPU_RECOVERY_ACTION_NONE


def test_inject_wakes_a_blocked_wait(nvml: MockNvml) -> None:
    es = _event_set(nvml)
    uuid = nvml.gpus[0].uuid
    timer = threading.Timer(0.05, nvml.inject_xid, args=(uuid, 31))
    timer.start()
    timeout_ms = 60_000  # no busy machine delays the injection this long
    t0 = time.monotonic()
    data = nvml.nvmlEventSetWait_v2(es, timeout_ms)
    timer.join()
    assert data.eventData == 31
    # woken by the injection, not at the timeout, however slow the machine
    assert time.monotonic() - t0 < timeout_ms / 1000 / 2


def test_inject_validation(nvml: MockNvml) -> None:
    with pytest.raises(KeyError):
        nvml.inject_xid("GPU-unknown", 79)
    with pytest.raises(ValueError):
        nvml.inject(HealthEvent(gpu_uuid=nvml.gpus[0].uuid, kind="xid"))
    with pytest.raises(ValueError):
        nvml.inject(HealthEvent(gpu_uuid=nvml.gpus[0].uuid, kind="melted"))


def test_event_set_free(nvml: MockNvml) -> None:
    es = _event_set(nvml)
    nvml.nvmlEventSetFree(es)
    for call in (lambda: nvml.nvmlEventSetWait_v2(es, 0), lambda: nvml.nvmlEventSetFree(es)):
        with pytest.raises(m.NVMLError) as err:
            call()
        assert err.value.value == m.NVML_ERROR_INVALID_ARGUMENT
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(m.NVMLError):
        nvml.nvmlDeviceRegisterEvents(h, m.nvmlEventTypeXidCriticalError, es)
    unsupported = 0x0020  # a bit outside the mask a real H200 reported (nvmlEventTypeAll)
    assert nvml.nvmlDeviceGetSupportedEventTypes(h) & unsupported == 0
    with pytest.raises(m.NVMLError) as err:
        nvml.nvmlDeviceRegisterEvents(h, unsupported, nvml.nvmlEventSetCreate())
    assert err.value.value == m.NVML_ERROR_NOT_SUPPORTED


def test_module_style_constant_access(nvml: MockNvml) -> None:
    assert nvml.NVML_ERROR_GPU_IS_LOST == 15
    assert nvml.NVML_GPU_INSTANCE_PROFILE_COUNT == 0x12
    assert nvml.nvmlEventTypeXidCriticalError == 8
    assert nvml.NVMLError_NotSupported is m.ERROR_CLASSES["NVMLError_NotSupported"]
    with pytest.raises(AttributeError):
        _ = nvml.nvmlDeviceGetNoSuchThing


def test_mig_constants_and_types_module_style(nvml: MockNvml) -> None:
    assert (
        nvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE == m.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE == 4
    )
    assert nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED == 0
    assert nvml.nvmlComputeInstanceProfileInfo_v2 == 0x02000088
    assert nvml.NVMLError_InUse(19).value == m.NVML_ERROR_IN_USE
    assert str(m.NVMLError(m.NVML_ERROR_IN_USE)) == "In use by another client"
    array = (nvml.c_nvmlGpuInstance_t * 2)()
    assert len(array) == 2 and not array[0]


def test_every_device_query_answers_a_mig_handle_without_crashing(nvml: MockNvml) -> None:
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceCreateGpuInstance(dev, 19)
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, m.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(dev, 0)
    answers: dict[str, object] = {}
    for name in sorted(n for n in dir(nvml) if n.startswith("nvmlDevice")):
        fn = getattr(nvml, name)
        params = list(inspect.signature(fn).parameters)
        if not params or params[0] not in ("handle", "device", "migDevice"):
            continue
        extra = {"nvmlDeviceRegisterEvents": (m.nvmlEventTypeXidCriticalError, None)}
        args: tuple[object, ...] = (mig, *extra.get(name, ()))
        args += (0,) * (len([p for p in params if p not in ("version",)]) - len(args))
        try:
            answers[name] = fn(*args)
        except m.NVMLError as err:
            answers[name] = type(err).__name__
    assert answers["nvmlDeviceGetUUID"] == nvml.nvmlDeviceGetUUID(mig)
    assert str(answers["nvmlDeviceGetUUID"]).startswith("MIG-")
    assert answers["nvmlDeviceGetName"] == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
    assert answers["nvmlDeviceGetMinorNumber"] == "NVMLError_NotSupported"
    assert answers["nvmlDeviceGetMigMode"] == "NVMLError_NotSupported"
    assert answers["nvmlDeviceRegisterEvents"] == "NVMLError_NotSupported"
    assert answers["nvmlDeviceGetGpuInstanceProfileInfo"] == "NVMLError_InvalidArgument"
    assert answers["nvmlDeviceGetPciInfo"] == nvml.nvmlDeviceGetPciInfo(dev)
    assert answers["nvmlDeviceGetDeviceHandleFromMigDeviceHandle"] is dev
    assert answers["nvmlDeviceGetGpuInstanceId"] == 13


def test_attributed_xid_carries_the_instance_ids(nvml: MockNvml) -> None:
    es = _event_set(nvml)
    uuid = nvml.gpus[0].uuid
    nvml.inject_xid(uuid, 94, gpu_instance_id=9, compute_instance_id=0)
    nvml.inject_xid(uuid, 79, gpu_instance_id=13)  # a GPU instance, no compute instance
    nvml.inject_xid(uuid, 79)  # the whole GPU
    nvml.inject(HealthEvent(uuid, "ecc-dbe"))
    got = [nvml.nvmlEventSetWait_v2(es, 0) for _ in range(4)]
    assert [(d.eventData, d.gpuInstanceId, d.computeInstanceId) for d in got] == [
        (94, 9, 0),
        (79, 13, 0xFFFFFFFF),
        (79, 0xFFFFFFFF, 0xFFFFFFFF),
        (0, 0xFFFFFFFF, 0xFFFFFFFF),
    ]


def test_attribution_validation(nvml: MockNvml) -> None:
    mig_gpu, plain_gpu = nvml.gpus[0].uuid, nvml.gpus[2].uuid  # H100 (MIG on), example
    with pytest.raises(ValueError, match="not in MIG mode"):
        nvml.inject_xid(plain_gpu, 79, gpu_instance_id=1)
    with pytest.raises(ValueError, match="only Xid events"):
        nvml.inject(HealthEvent(mig_gpu, "ecc-dbe", gpu_instance_id=1))
    with pytest.raises(ValueError, match="needs its GPU instance"):
        nvml.inject_xid(mig_gpu, 79, compute_instance_id=0)
    with pytest.raises(ValueError, match="out of range"):
        nvml.inject_xid(mig_gpu, 79, gpu_instance_id=0xFFFFFFFF)
    es = _event_set(nvml)
    with pytest.raises(m.NVMLError) as err:  # nothing was queued
        nvml.nvmlEventSetWait_v2(es, 0)
    assert err.value.value == m.NVML_ERROR_TIMEOUT
