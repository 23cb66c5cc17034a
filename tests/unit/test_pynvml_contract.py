"""The backend only uses real pynvml API, and MockNvml has the same shape as pynvml.

A recording proxy over MockNvml runs discovery and the health-event path; every
attribute the backend touches must exist in the installed pynvml, every call must bind
to the real function's signature, and the mock's functions, constants, error classes
and struct fields must match pynvml's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pynvml
import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.calls import CountingModule
from driver.nvml.discovered import HealthEvent
from driver.nvml.health_events import HealthEventSet
from driver.nvml.mock import mock_api as m
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mig import mig_state as mock_mig_state
from driver.nvml.mock.mig import mock_mig
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.recovery_action import ACTION_NAMES, FIELD_RECOVERY_ACTION, RecoveryActionReader


class Recorder:
    def __init__(self, inner: MockNvml) -> None:
        self._inner = inner
        self.attributes: set[str] = set()
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        self.attributes.add(name)
        attr = getattr(self._inner, name)
        if name.startswith("nvml") and callable(attr):

            def record(*args: Any, **kwargs: Any) -> Any:
                self.calls.append((name, args, kwargs))
                return attr(*args, **kwargs)

            return record
        return attr


@pytest.fixture(scope="module")
def recorded() -> Recorder:
    fleet = parse_fleet(
        {"gpus": [{"model": "H100-80GB", "count": 2}, {"model": "example", "count": 1}]}
    )
    inner = MockNvml(fleet, "node-a")
    rec = Recorder(inner)
    backend = NvmlBackend(rec, backend_name="mock")
    backend.discover()
    backend.open_event_set()
    inner.set_recovery_action(inner.gpus[0].uuid, 1)
    backend.recovery_actions([g.uuid for g in inner.gpus])
    inner.inject_xid(inner.gpus[0].uuid, 79)
    inner.inject(HealthEvent(gpu_uuid=inner.gpus[1].uuid, kind="ecc-dbe"))
    inner.inject_gpu_lost(inner.gpus[1].uuid)
    inner.reset(inner.gpus[1].uuid)
    for _ in range(5):
        backend.wait_event(1)
    backend.close_event_set()
    return rec


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_backend_exercised_the_whole_api(recorded: Recorder) -> None:
    called = {name for name, _, _ in recorded.calls}
    expected = {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlSystemGetDriverVersion",
        "nvmlSystemGetCudaDriverVersion",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetMinorNumber",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetBrand",
        "nvmlDeviceGetArchitecture",
        "nvmlDeviceGetCudaComputeCapability",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetGpuInstanceProfileInfo",
        "nvmlDeviceGetGpuInstancePossiblePlacements",
        "nvmlEventSetCreate",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlEventSetFree",
        "nvmlDeviceGetFieldValues",
    }
    assert expected <= called, expected - called


def test_every_attribute_the_backend_uses_exists_in_pynvml(recorded: Recorder) -> None:
    missing = sorted(a for a in recorded.attributes if not hasattr(pynvml, a))
    assert not missing, f"backend uses names pynvml lacks: {missing}"


def test_every_backend_call_binds_to_the_real_signature(recorded: Recorder) -> None:
    for name, args, kwargs in recorded.calls:
        real = getattr(pynvml, name)
        try:
            inspect.signature(real).bind(*args, **kwargs)
        except TypeError as err:
            pytest.fail(f"{name}{args!r} does not bind to pynvml.{name}: {err}")


def test_constants_the_backend_reads_match_pynvml(recorded: Recorder) -> None:
    for name in recorded.attributes:
        value = getattr(MockNvml(parse_fleet({"gpus": [{"model": "example"}]}), "n"), name)
        if isinstance(value, int):
            assert value == getattr(pynvml, name), name


def test_mock_functions_have_pynvml_signatures() -> None:
    names = [n for n in dir(MockNvml) if n.startswith("nvml")]
    assert len(names) >= 41
    mock = MockNvml(parse_fleet({"gpus": [{"model": "example"}]}), "n")
    for name in names:
        assert hasattr(pynvml, name), f"pynvml has no {name}"
        assert _params(getattr(mock, name)) == _params(getattr(pynvml, name)), name


def test_mock_constants_match_pynvml() -> None:
    checked = 0
    for module in (m, mock_mig, mock_mig_state):
        for name, value in vars(module).items():
            prefixes = ("NVML_", "nvmlEvent", "nvmlMemory_v", "nvmlGpuInstanceProfileInfo_v")
            if name.startswith((*prefixes, "nvmlComputeInstanceProfileInfo_v")) and isinstance(
                value, int
            ):
                assert getattr(pynvml, name) == value, f"{module.__name__}.{name}"
                checked += 1
    assert checked > 90
    for name in dir(pynvml):  # every compute-instance constant pynvml has, the mock has
        if name.startswith("NVML_COMPUTE_INSTANCE_"):
            assert getattr(m, name) == getattr(pynvml, name), name


def test_mock_error_classes_match_pynvml() -> None:
    code_of = {cls: code for code, cls in m.NVMLError._by_code.items()}
    for name, cls in m.ERROR_CLASSES.items():
        real = getattr(pynvml, name)
        assert issubclass(real, pynvml.NVMLError)
        assert real().value == code_of[cls], name
    for code in (1, 2, 3, 6, 7, 10, 13, 15, 999):
        assert type(m.NVMLError(code)).__name__ == type(pynvml.NVMLError(code)).__name__
        assert m.NVMLError(code).value == pynvml.NVMLError(code).value


def _ctypes_fields(struct: Any) -> set[str]:
    return {f[0] for f in struct._fields_}


@pytest.mark.parametrize(
    ("mock_struct", "real_struct"),
    [
        (m.MemoryInfo, pynvml.c_nvmlMemory_v2_t),
        (m.PciInfo, pynvml.nvmlPciInfo_t),
        (m.GpuInstanceProfileInfo, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t),
        (m.EventData, pynvml.c_nvmlEventData_t),
    ],
)
def test_struct_field_names_match(mock_struct: Any, real_struct: Any) -> None:
    mock_fields = {f.name for f in dataclasses.fields(mock_struct)}
    assert mock_fields <= _ctypes_fields(real_struct)
    # The v1 memory struct (no version) has total/free/used only.
    if mock_struct is m.MemoryInfo:
        assert {"total", "free", "used"} == _ctypes_fields(pynvml.c_nvmlMemory_t)


def test_event_data_has_every_field_of_pynvml() -> None:
    """The mock reports the MIG attribution fields the real wait fills (nvml.h
    nvmlEventData_t: device, eventType, eventData, gpuInstanceId, computeInstanceId)."""
    assert [f.name for f in dataclasses.fields(m.EventData)] == [
        f[0] for f in pynvml.c_nvmlEventData_t._fields_
    ]
    assert m.EventData(m.MockDeviceHandle(0), 8, 79).gpuInstanceId == 0xFFFFFFFF


@pytest.mark.parametrize(
    ("gi", "ci", "expected"),
    [
        (0xFFFFFFFF, 0xFFFFFFFF, (None, None)),
        (9, 0, (9, 0)),
        (13, 0xFFFFFFFF, (13, None)),
        (0xFFFFFFFF, 2, (None, None)),  # a compute instance lives in a GPU instance
    ],
)
def test_backend_reads_instance_ids_from_the_real_struct(
    gi: int, ci: int, expected: tuple[int | None, int | None]
) -> None:
    nvml = MockNvml(parse_fleet({"gpus": [{"model": "H100-80GB"}]}), "n")
    events = HealthEventSet(CountingModule(nvml))
    data = pynvml.c_nvmlEventData_t()  # device NULL: register it as a known handle
    events._event_handles[("ptr", None)] = "GPU-x"
    data.eventType, data.eventData = pynvml.nvmlEventTypeXidCriticalError, 94
    data.gpuInstanceId, data.computeInstanceId = gi, ci
    event = events._translate(data)
    assert event is not None and (event.gpu_uuid, event.kind, event.xid) == ("GPU-x", "xid", 94)
    assert (event.gpu_instance_id, event.compute_instance_id) == expected
    data.eventType, data.eventData = pynvml.nvmlEventTypeDoubleBitEccError, 0
    ecc = events._translate(data)
    assert ecc is not None and (ecc.gpu_instance_id, ecc.compute_instance_id) == (None, None)


def test_placement_struct_matches() -> None:
    assert _ctypes_fields(m.c_nvmlGpuInstancePlacement_t) == _ctypes_fields(
        pynvml.c_nvmlGpuInstancePlacement_t
    )


@pytest.mark.parametrize(
    ("mock_struct", "real_struct"),
    [
        (mock_mig_state.Placement, pynvml.c_nvmlGpuInstancePlacement_t),
        (mock_mig_state.Placement, pynvml.c_nvmlComputeInstancePlacement_t),
        (mock_mig_state.GpuInstanceInfo, pynvml.c_nvmlGpuInstanceInfo_t),
        (mock_mig_state.ComputeInstanceInfo, pynvml.c_nvmlComputeInstanceInfo_t),
        (mock_mig_state.ComputeInstanceProfileInfo, pynvml.c_nvmlComputeInstanceProfileInfo_v2_t),
    ],
)
def test_mig_struct_field_names_match(mock_struct: Any, real_struct: Any) -> None:
    assert {f.name for f in dataclasses.fields(mock_struct)} == _ctypes_fields(real_struct)


def test_mig_handle_types_are_pointer_types_as_in_pynvml() -> None:
    for name in ("c_nvmlGpuInstance_t", "c_nvmlComputeInstance_t"):
        mock_type, real_type = getattr(MockNvml, name), getattr(pynvml, name)
        assert issubclass(mock_type, ctypes._Pointer) and issubclass(real_type, ctypes._Pointer)
        assert mock_type._type_.__name__ == real_type._type_.__name__


MIG_FUNCTIONS = {
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceGetGpuInstanceById",
    "nvmlDeviceGetGpuInstances",
    "nvmlGpuInstanceGetInfo",
    "nvmlGpuInstanceDestroy",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceGetComputeInstanceById",
    "nvmlGpuInstanceGetComputeInstances",
    "nvmlComputeInstanceGetInfo",
    "nvmlComputeInstanceGetInfo_v2",
    "nvmlComputeInstanceDestroy",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
}


@pytest.fixture
def mig_recorded(tmp_path: Path) -> Recorder:
    """A MIG lifecycle driven the way a pynvml caller drives it, through a recorder."""
    fleet = parse_fleet(
        {"gpus": [{"model": "H100-80GB", "migInstances": [{"profile": "1g.10gb", "start": 6}]}]}
    )
    inner = MockNvml(fleet, "node-a", driver_root=tmp_path)
    nvml = Recorder(inner)
    nvml.nvmlInit()
    dev = nvml.nvmlDeviceGetHandleByIndex(0)
    placement = nvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = 0, 4
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(dev, 9, ctypes.byref(placement))
    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi,
        nvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    )
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    nvml.nvmlComputeInstanceGetInfo(ci)
    cis = (nvml.c_nvmlComputeInstance_t * info.instanceCount)()
    count = ctypes.c_uint(info.instanceCount)
    nvml.nvmlGpuInstanceGetComputeInstances(gi, info.id, cis, ctypes.byref(count))
    nvml.nvmlGpuInstanceGetComputeInstanceById(gi, nvml.nvmlComputeInstanceGetInfo_v2(cis[0]).id)
    gis = (nvml.c_nvmlGpuInstance_t * 2)()
    nvml.nvmlDeviceGetGpuInstances(dev, 9, gis, ctypes.byref(count))
    nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(dev, 1))
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(dev)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(dev, i)
        except nvml.NVMLError_NotFound:
            continue
        assert nvml.nvmlDeviceIsMigDeviceHandle(mig)
        nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        nvml.nvmlDeviceGetGpuInstanceId(mig)
        nvml.nvmlDeviceGetComputeInstanceId(mig)
        nvml.nvmlDeviceGetUUID(mig)
        nvml.nvmlDeviceGetMemoryInfo(mig)
    nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)
    nvml.nvmlDeviceCreateGpuInstance(dev, 19)
    return nvml


def test_every_mig_function_is_a_pynvml_function_with_its_signature(
    mig_recorded: Recorder,
) -> None:
    mock = MockNvml(parse_fleet({"gpus": [{"model": "example"}]}), "n")
    for name in MIG_FUNCTIONS:
        assert _params(getattr(mock, name)) == _params(getattr(pynvml, name)), name
    assert {name for name, _, _ in mig_recorded.calls} >= MIG_FUNCTIONS


def test_mig_calls_bind_and_use_only_pynvml_names(mig_recorded: Recorder) -> None:
    missing = sorted(a for a in mig_recorded.attributes if not hasattr(pynvml, a))
    assert not missing, f"names pynvml lacks: {missing}"
    for name, args, kwargs in mig_recorded.calls:
        inspect.signature(getattr(pynvml, name)).bind(*args, **kwargs)


# -- the recovery action (nvmlDeviceGetFieldValues) --------------------------------------


@pytest.mark.parametrize(
    ("mock_struct", "real_struct"),
    [
        (m.c_nvmlFieldValue_t, pynvml.c_nvmlFieldValue_t),
        (m.c_nvmlValue_t, pynvml.c_nvmlValue_t),
    ],
)
def test_field_value_structs_have_pynvmls_layout(mock_struct: Any, real_struct: Any) -> None:
    assert [(name, ctypes.sizeof(kind)) for name, kind in mock_struct._fields_] == [
        (name, ctypes.sizeof(kind)) for name, kind in real_struct._fields_
    ]
    assert ctypes.sizeof(mock_struct) == ctypes.sizeof(real_struct)


def test_recovery_action_names_are_pynvmls() -> None:
    assert FIELD_RECOVERY_ACTION == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    for code, name in ACTION_NAMES.items():
        constant = "NVML_GPU_RECOVERY_ACTION_" + name.upper().replace("-", "_")
        assert getattr(pynvml, constant) == code, constant


class RealStructs:
    """The mock answering in pynvml's own ctypes array, as the real call returns it."""

    def __init__(self, inner: MockNvml) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        answer = self._inner.nvmlDeviceGetFieldValues(handle, fieldIds)
        real = (pynvml.c_nvmlFieldValue_t * len(answer))()
        ctypes.memmove(real, answer, ctypes.sizeof(real))
        return real


def test_reader_decodes_pynvmls_field_value_struct() -> None:
    inner = MockNvml(parse_fleet({"gpus": [{"model": "H100-80GB", "count": 2}]}), "n")
    inner.set_recovery_action(inner.gpus[1].uuid, pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P)
    reader = RecoveryActionReader(CountingModule(RealStructs(inner)))
    readings = reader.read([g.uuid for g in inner.gpus])
    assert [r.action for r in readings] == [0, pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P]
