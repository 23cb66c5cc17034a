"""Discovery: every GPU NVML reports, with its MIG profiles, placements and instances,
into an Inventory. NOT_SUPPORTED answers leave optional fields None and never fail
discovery."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from driver.nvml.calls import CountingModule, is_nvml_error, nvml_text, optional_query
from driver.nvml.discovered import GpuInfo, Inventory, PartitionProfile
from driver.nvml.library import init_nvml
from driver.nvml.mig.mig_manager import MigManager

log = logging.getLogger(__name__)

ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}
BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}


def normalize_pci_bus_id(bus_id: str | bytes) -> str:
    """`00000000:3B:00.0` -> `0000:3b:00.0` (lower case, 4-hex-digit domain)."""
    text = nvml_text(bus_id).strip().rstrip("\x00").lower()
    domain, sep, rest = text.partition(":")
    if sep and len(domain) == 8 and domain.startswith("0000"):
        domain = domain[4:]
    return f"{domain}{sep}{rest}"


def format_cuda_driver_version(version: int) -> str:
    """NVML's integer CUDA driver version (13000, 12040) -> "13.0", "12.4"."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def discover_inventory(nvml: CountingModule, backend_name: str, mig: MigManager) -> Inventory:
    """Walk every GPU NVML reports; GPUs that are lost are skipped with a warning. `mig`
    lists the MIG devices (and keeps what it learns of each GPU's profiles for the
    prepares to come)."""
    init_nvml(nvml)
    try:
        driver_version = nvml_text(nvml.nvmlSystemGetDriverVersion())
        cuda = optional_query(nvml, nvml.nvmlSystemGetCudaDriverVersion, "CUDA version")
        gpus: list[GpuInfo] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                gpus.append(_gpu_info(nvml, mig, index, handle))
            except nvml.NVMLError as err:
                if not is_nvml_error(nvml, err, "NVML_ERROR_GPU_IS_LOST"):
                    raise
                log.warning("GPU at NVML index %d is lost; not published: %s", index, err)
        return Inventory(
            backend=backend_name,
            driver_version=driver_version,
            cuda_driver_version=format_cuda_driver_version(cuda) if cuda else None,
            gpus=tuple(gpus),
        )
    finally:
        nvml.nvmlShutdown()


def _gpu_info(nvml: CountingModule, mig: MigManager, index: int, handle: Any) -> GpuInfo:
    minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
    uuid = nvml_text(nvml.nvmlDeviceGetUUID(handle))
    product_name = nvml_text(nvml.nvmlDeviceGetName(handle))
    pci_bus_id = normalize_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
    memory = optional_query(nvml, lambda: nvml.nvmlDeviceGetMemoryInfo(handle), "memory", uuid)
    brand = optional_query(nvml, lambda: nvml.nvmlDeviceGetBrand(handle), "brand", uuid)
    arch = optional_query(nvml, lambda: nvml.nvmlDeviceGetArchitecture(handle), "arch", uuid)
    cc = optional_query(nvml, lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle), "cc", uuid)
    mig_mode = optional_query(nvml, lambda: nvml.nvmlDeviceGetMigMode(handle), "MIG mode", uuid)
    mig_capable = mig_mode is not None
    mig_enabled = mig_mode is not None and int(mig_mode[0]) == nvml.NVML_DEVICE_MIG_ENABLE
    profiles = _partition_profiles(nvml, handle, uuid) if mig_capable else ()
    instances = tuple(mig.instances(uuid, initialised=True)) if mig_enabled and profiles else ()
    return GpuInfo(
        index=index,
        minor=minor,
        uuid=uuid,
        product_name=product_name,
        pci_bus_id=pci_bus_id,
        memory_bytes=int(memory.total) if memory is not None else None,
        brand=BRANDS.get(int(brand), "Unknown") if brand is not None else None,
        architecture=ARCHITECTURES.get(int(arch), "Unknown") if arch is not None else None,
        cuda_compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
        mig_capable=mig_capable,
        mig_enabled=mig_enabled,
        memory_slices=max((s + n for p in profiles for s, n in p.placements), default=0),
        multiprocessors=max((p.multiprocessors for p in profiles), default=None),
        partition_profiles=profiles,
        mig_instances=instances,
    )


def _partition_profiles(
    nvml: CountingModule, handle: Any, uuid: str
) -> tuple[PartitionProfile, ...]:
    profiles: list[PartitionProfile] = []
    for slot in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, slot)
            placements = _placements(nvml, handle, int(info.id))
        except nvml.NVMLError as err:
            if is_nvml_error(nvml, err, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                continue
            raise
        name = nvml_text(info.name).strip().removeprefix("MIG ").strip()
        if not name or not placements:
            continue
        profiles.append(
            PartitionProfile(
                name=name,
                profile_id=int(info.id),
                slice_count=int(info.sliceCount),
                memory_bytes=int(info.memorySizeMB) * 1024 * 1024,
                multiprocessors=int(info.multiprocessorCount),
                copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount),
                encoders=int(info.encoderCount),
                jpeg_engines=int(info.jpegCount),
                ofa_engines=int(info.ofaCount),
                placements=placements,
                instance_count=int(info.instanceCount),
            )
        )
    log.debug("GPU %s: %d MIG profiles", uuid, len(profiles))
    return tuple(profiles)


def _placements(nvml: CountingModule, handle: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
    count = ctypes.c_uint(0)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.pointer(count))
    if count.value == 0:
        return ()
    array = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
        handle, profile_id, array, ctypes.pointer(count)
    )
    return tuple((int(array[i].start), int(array[i].size)) for i in range(count.value))
