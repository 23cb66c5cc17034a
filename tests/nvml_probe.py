"""The same NVML calls, in the same order, against real pynvml or the mock: what each
call answers (a value, the shape of one, or the NVML error), so that the mock can be
held to what a real GPU answered (tests/unit/test_mock_nvml_parity.py replays a
transcript recorded on a GPU; tests/gpu/test_nvml_parity.py compares live).

Only calls the driver makes, plus the error cases it relies on. Nothing is created,
changed or destroyed; the event set is freed. Values that name one GPU (UUID, PCI
address, serial) or one driver build are recorded by type and shape only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import pynvml

ERROR_NAMES = {v: k for k, v in vars(pynvml).items() if k.startswith("NVML_ERROR_")}
UNKNOWN_GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"
UNKNOWN_MIG_UUID = "MIG-00000000-0000-0000-0000-000000000000"
PROFILE_1_SLICE = 0  # NVML_GPU_INSTANCE_PROFILE_1_SLICE
NOT_A_PROFILE = 99

Answer = list[Any]  # ["ok", value] or ["err", "NVML_ERROR_..."]


def _type(value: Any) -> str:
    return type(value).__name__


def _profile_row(info: Any) -> list[int]:
    """A GPU-instance profile as the MIG table has it: id, slices, instances, memory
    (MiB), SMs, copy engines, decoders, encoders, JPEG and OFA engines."""
    return [
        int(info.id),
        int(info.sliceCount),
        int(info.instanceCount),
        int(info.memorySizeMB),
        int(info.multiprocessorCount),
        int(info.copyEngineCount),
        int(info.decoderCount),
        int(info.encoderCount),
        int(info.jpegCount),
        int(info.ofaCount),
    ]


def probe(nvml: Any) -> dict[str, Answer]:
    """Each call's answer on the first GPU, keyed by what it asks."""
    answers: dict[str, Answer] = {}

    def ask(
        key: str, call: Callable[..., Any], *args: Any, show: Callable[[Any], Any] = _type
    ) -> Any:
        try:
            value = call(*args)
        except nvml.NVMLError as err:
            answers[key] = ["err", ERROR_NAMES.get(err.value, f"code {err.value}")]
            return None
        answers[key] = ["ok", show(value)]
        return value

    def same(value: Any) -> Any:
        return value

    ask("call_before_init", nvml.nvmlDeviceGetCount)
    ask("init", nvml.nvmlInit)
    ask("driver_version", nvml.nvmlSystemGetDriverVersion)
    ask("cuda_version", nvml.nvmlSystemGetCudaDriverVersion)
    count = ask("count", nvml.nvmlDeviceGetCount, show=same)
    handle = ask("handle0", nvml.nvmlDeviceGetHandleByIndex, 0, show=lambda v: "handle")
    ask("handle_out_of_range", nvml.nvmlDeviceGetHandleByIndex, count)
    ask("handle_negative", nvml.nvmlDeviceGetHandleByIndex, -1)
    uuid = ask("uuid", nvml.nvmlDeviceGetUUID, handle, show=lambda v: [_type(v), str(v)[:4]])
    ask("by_uuid", nvml.nvmlDeviceGetHandleByUUID, uuid, show=lambda v: "handle")
    ask("by_uuid_unknown", nvml.nvmlDeviceGetHandleByUUID, UNKNOWN_GPU_UUID)
    ask("by_uuid_malformed", nvml.nvmlDeviceGetHandleByUUID, "bogus")
    ask("by_uuid_mig_unknown", nvml.nvmlDeviceGetHandleByUUID, UNKNOWN_MIG_UUID)
    ask("minor", nvml.nvmlDeviceGetMinorNumber, handle)
    ask("name", nvml.nvmlDeviceGetName, handle)
    ask("brand", nvml.nvmlDeviceGetBrand, handle, show=same)
    ask("arch", nvml.nvmlDeviceGetArchitecture, handle, show=same)
    ask("cc", nvml.nvmlDeviceGetCudaComputeCapability, handle, show=list)
    ask("mem_total", nvml.nvmlDeviceGetMemoryInfo, handle, show=lambda v: _type(v.total))
    ask("pci", nvml.nvmlDeviceGetPciInfo, handle, show=lambda v: [_type(v.busId), len(v.busId)])
    ask("mig_mode", nvml.nvmlDeviceGetMigMode, handle, show=list)
    ask("max_mig", nvml.nvmlDeviceGetMaxMigDeviceCount, handle, show=same)
    ask(
        "gi_profile_info_1slice",
        nvml.nvmlDeviceGetGpuInstanceProfileInfo,
        handle,
        PROFILE_1_SLICE,
        show=lambda v: [v.id, v.sliceCount, v.instanceCount, v.memorySizeMB],
    )
    ask("gi_profile_info_bad", nvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, NOT_A_PROFILE)
    for slot in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):  # the whole MIG table
        ask(
            f"gi_profile_{slot}",
            nvml.nvmlDeviceGetGpuInstanceProfileInfo,
            handle,
            slot,
            show=_profile_row,
        )
    placements = ctypes.c_uint(0)
    ask(
        "gi_placements_count",
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements,
        handle,
        PROFILE_1_SLICE,
        None,
        ctypes.pointer(placements),
        show=lambda v: placements.value,
    )
    instances = (nvml.c_nvmlGpuInstance_t * 8)()
    listed = ctypes.c_uint(8)
    ask(
        "gi_list",
        nvml.nvmlDeviceGetGpuInstances,
        handle,
        PROFILE_1_SLICE,
        instances,
        ctypes.byref(listed),
        show=lambda v: listed.value,
    )
    ask("gi_by_id", nvml.nvmlDeviceGetGpuInstanceById, handle, 1, show=lambda v: "instance")
    ask("mig_handle0", nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, 0, show=lambda v: "handle")
    ask("gi_id_of_gpu", nvml.nvmlDeviceGetGpuInstanceId, handle)
    ask("ci_id_of_gpu", nvml.nvmlDeviceGetComputeInstanceId, handle)
    ask("events_supported", nvml.nvmlDeviceGetSupportedEventTypes, handle, show=same)
    event_set = ask("eventset", nvml.nvmlEventSetCreate, show=lambda v: "set")
    xid = nvml.nvmlEventTypeXidCriticalError
    ask("register_xid", nvml.nvmlDeviceRegisterEvents, handle, xid, event_set)
    ask("wait_0ms", nvml.nvmlEventSetWait_v2, event_set, 0)
    ask("wait_10ms", nvml.nvmlEventSetWait_v2, event_set, 10)
    ask("eventset_free", nvml.nvmlEventSetFree, event_set)
    ask(
        "field_recovery",
        nvml.nvmlDeviceGetFieldValues,
        handle,
        [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION],
        show=lambda v: [int(v[0].nvmlReturn), int(v[0].valueType), int(v[0].value.uiVal)],
    )
    ask("shutdown", nvml.nvmlShutdown)
    ask("call_after_shutdown", nvml.nvmlDeviceGetCount)
    return answers


def record(nvml: Any) -> dict[str, Any]:
    """The probe's answers with the GPU they came from: the transcript a mock is held to."""
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        gpu = {
            "name": nvml.nvmlDeviceGetName(handle),
            "driver": nvml.nvmlSystemGetDriverVersion(),
            "mig_mode": nvml.nvmlDeviceGetMigMode(handle)[0],
        }
    finally:
        nvml.nvmlShutdown()
    return {"gpu": gpu, "answers": probe(nvml)}


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    Path(sys.argv[1]).write_text(json.dumps(record(pynvml), indent=1, sort_keys=True) + "\n")
