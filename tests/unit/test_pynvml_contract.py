"""The backend only uses real pynvml API, and MockNvml has the same shape as pynvml.

A recording proxy over MockNvml runs discovery and the health-event path; every
attribute the backend touches must exist in the installed pynvml, every call must bind
to the real function's signature, and the mock's functions, constants, error classes
and struct fields must match pynvml's.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pynvml
import pytest

from driver.nvml import mock as m
from driver.nvml.backend import NvmlBackend
from driver.nvml.fleet import parse_fleet


class Recorder:
    def __init__(self, inner: m.MockNvml) -> None:
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
    inner = m.MockNvml(fleet, "node-a")
    rec = Recorder(inner)
    backend = NvmlBackend(rec, backend_name="mock")
    backend.discover()
    backend.open_event_set()
    inner.inject_xid(inner.gpus[0].uuid, 79)
    inner.inject(m.HealthEvent(gpu_uuid=inner.gpus[1].uuid, kind="ecc-dbe"))
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
        value = getattr(m.MockNvml(parse_fleet({"gpus": [{"model": "example"}]}), "n"), name)
        if isinstance(value, int):
            assert value == getattr(pynvml, name), name


def test_mock_functions_have_pynvml_signatures() -> None:
    names = [n for n in dir(m.MockNvml) if n.startswith("nvml")]
    assert len(names) >= 22
    mock = m.MockNvml(parse_fleet({"gpus": [{"model": "example"}]}), "n")
    for name in names:
        assert hasattr(pynvml, name), f"pynvml has no {name}"
        assert _params(getattr(mock, name)) == _params(getattr(pynvml, name)), name


def test_mock_constants_match_pynvml() -> None:
    checked = 0
    for name, value in vars(m).items():
        prefixes = ("NVML_", "nvmlEvent", "nvmlMemory_v", "nvmlGpuInstanceProfileInfo_v")
        if name.startswith(prefixes) and isinstance(value, int):
            assert getattr(pynvml, name) == value, name
            checked += 1
    assert checked > 60


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


def test_placement_struct_matches() -> None:
    assert _ctypes_fields(m.c_nvmlGpuInstancePlacement_t) == _ctypes_fields(
        pynvml.c_nvmlGpuInstancePlacement_t
    )
