"""The model behind the mock NVML's MIG devices: instance records, placement, IDs, and
the numbering of the capability files (`mig_minor`). `driver.nvml.mock.mig.mig_store`
keeps the records of a node.
"""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from driver.nvml.mock.fleet import MigPlacement, MigProfileSpec, MigSpec, MockGpu, mig_conflict
from driver.nvml.mock.mock_api import (
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    MigError,
)

STATE_FILE = Path("run/nvidia-mock/mig-state.json")
CAPABILITIES_DIR = Path("proc/driver/nvidia/capabilities")
MIG_MINORS_FILE = Path("proc/driver/nvidia-caps/mig-minors")

CI_SLOT = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}  # slices -> CI profile
MAX_CIS = 8  # compute instances per GPU instance (capabilities ci0..ci7)
CAP_GPUS, _CAP_GIS, _CAP_FIRST = 32, 15, 3  # nv-caps.c tables: gpu0-31, gi0-14
_MODE_RUGO, MODE_RUSR = 0o444, 0o400
_MIG_UUID_NAMESPACE = uuidlib.UUID("0b5a3c55-7d7e-4f5e-9a6c-2f4e8d1c3b7a")


# ------------------------------------------------------------------ NVML structs and handles


@dataclass
class Placement:  # c_nvmlGpuInstancePlacement_t / c_nvmlComputeInstancePlacement_t
    start: int
    size: int


@dataclass
class GpuInstanceInfo:  # c_nvmlGpuInstanceInfo_t
    device: Any
    id: int
    profileId: int
    placement: Placement


@dataclass
class ComputeInstanceInfo:  # c_nvmlComputeInstanceInfo_t
    device: Any
    gpuInstance: Any
    id: int
    profileId: int
    placement: Placement


@dataclass
class ComputeInstanceProfileInfo:  # c_nvmlComputeInstanceProfileInfo_v2_t
    version: int
    id: int
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    sharedCopyEngineCount: int
    sharedDecoderCount: int
    sharedEncoderCount: int
    sharedJpegCount: int
    sharedOfaCount: int
    name: str


class struct_c_nvmlGpuInstance_t(ctypes.Structure):
    pass  # opaque, as in pynvml


class struct_c_nvmlComputeInstance_t(ctypes.Structure):
    pass  # opaque, as in pynvml


# Handle types, for callers that build arrays: `(nvml.c_nvmlGpuInstance_t * n)()`.
c_nvmlGpuInstance_t = ctypes.POINTER(struct_c_nvmlGpuInstance_t)
c_nvmlComputeInstance_t = ctypes.POINTER(struct_c_nvmlComputeInstance_t)


@dataclass(frozen=True)
class MockGpuInstance:
    """Opaque GPU instance handle (pynvml: c_nvmlGpuInstance_t)."""

    gpu: int
    id: int
    serial: int


@dataclass(frozen=True)
class MockComputeInstance:
    """Opaque compute instance handle (pynvml: c_nvmlComputeInstance_t)."""

    gpu: int
    gi: int
    ci: int
    serial: int


@dataclass(frozen=True)
class MockMigDeviceHandle:
    """A MIG device handle (pynvml: c_nvmlDevice_t of a MIG device)."""

    gpu: int
    gi: int
    ci: int
    serial: int


@dataclass(frozen=True)
class MigDevice:
    """What a MIG device handle resolves to (for MockNvml's device queries)."""

    gpu: MockGpu
    uuid: str
    profile: MigProfileSpec  # the GPU instance's
    name: str  # the compute instance profile's, e.g. "1g.10gb" or "1c.7g.80gb"


# --------------------------------------------------------------------------- records


@dataclass
class CiRecord:
    id: int
    profile: int
    start: int
    size: int
    serial: int


@dataclass
class GiRecord:
    id: int
    profile: int
    start: int
    size: int
    serial: int
    cis: list[CiRecord] = field(default_factory=list)


@dataclass
class State:
    """The MIG instances of a node (the state file's content)."""

    serial: int = 0  # last serial issued; handles name the serial of their instance
    gpus: dict[str, list[GiRecord]] = field(default_factory=dict)  # GPU UUID -> GPU instances

    def issue(self) -> int:
        self.serial += 1
        return self.serial


@dataclass(frozen=True)
class CiProfile:
    id: int
    slices: int
    name: str
    starts: tuple[int, ...]
    multiprocessors: int


def _memory_slices(mig: MigSpec) -> int:
    return max(start + size for p in mig.profiles for start, size in p.placements)


def _gi_id(mig: MigSpec, start: int, size: int) -> int:
    level = (_memory_slices(mig) // size).bit_length() - 1
    return (1 << level) - 1 + start // size


def _placed(mig: MigSpec, gis: Sequence[GiRecord]) -> list[MigPlacement]:
    return [MigPlacement(cast(MigProfileSpec, mig.by_id(g.profile)), g.start, g.size) for g in gis]


def _best_fit(mig: MigSpec, placed: list[MigPlacement], profile: MigProfileSpec) -> MigPlacement:
    used = {s for p in placed for s in range(p.start, p.start + p.size)}
    memory, usable = _memory_slices(mig), mig.compute_slices

    def fit(new: MigPlacement) -> tuple[list[int], int]:
        key, block = [], new.size
        while block <= memory:
            lo = new.start // block * block
            key.append(sum(1 for s in range(lo, min(lo + block, usable)) if s not in used))
            block *= 2
        return key, new.start

    free = [MigPlacement(profile, start, size) for start, size in profile.placements]
    free = [p for p in free if mig_conflict(mig, placed, p) is None]
    if not free:
        raise MigError(NVML_ERROR_INSUFFICIENT_RESOURCES)
    return min(free, key=fit)


def create_gi(
    st: State, gpu: MockGpu, profile: MigProfileSpec, at: tuple[int, int] | None
) -> GiRecord:
    """Add a GPU instance at placement `at` (start, size), or at the best fit if None."""
    mig = cast(MigSpec, gpu.profile.mig)
    gis = st.gpus.setdefault(gpu.uuid, [])
    if at is None:
        new = _best_fit(mig, _placed(mig, gis), profile)
    elif at not in profile.placements:
        raise MigError(NVML_ERROR_INVALID_ARGUMENT)
    else:
        new = MigPlacement(profile, *at)
        if mig_conflict(mig, _placed(mig, gis), new) is not None:
            raise MigError(NVML_ERROR_INSUFFICIENT_RESOURCES)
    gi = GiRecord(_gi_id(mig, new.start, new.size), profile.id, new.start, new.size, st.issue())
    gis.append(gi)
    gis.sort(key=lambda g: g.id)
    return gi


def ci_profiles(mig: MigSpec, gi: MigProfileSpec) -> dict[int, CiProfile]:
    """The compute instance profiles of a GPU instance of profile `gi`, by profile ID."""
    n, out = gi.sliceCount, {}
    for c in sorted({1, 2, 3, 4, n}):
        if c > n or c not in CI_SLOT:
            continue
        if c == n:
            out[CI_SLOT[c]] = CiProfile(CI_SLOT[c], c, gi.name, (0,), gi.multiprocessors)
            continue
        plain = next((p for p in mig.profiles if p.slot == f"{c}_SLICE"), None)
        sms = plain.multiprocessors if plain else gi.multiprocessors * c // n
        starts = tuple(range(0, n - c + 1, 1 << (c - 1).bit_length()))
        out[CI_SLOT[c]] = CiProfile(CI_SLOT[c], c, f"{c}c.{gi.name}", starts, sms)
    return out


def create_ci(st: State, gi: GiRecord, prof: CiProfile) -> CiRecord:
    """Add a compute instance of `prof` to `gi`: lowest free placement, lowest free ID."""

    def free(start: int) -> bool:
        return all(start + prof.slices <= c.start or c.start + c.size <= start for c in gi.cis)

    start = next((s for s in prof.starts if free(s)), None)
    if start is None:
        raise MigError(NVML_ERROR_INSUFFICIENT_RESOURCES)
    taken = {c.id for c in gi.cis}
    ci = CiRecord(min(set(range(MAX_CIS)) - taken), prof.id, start, prof.slices, st.issue())
    gi.cis.append(ci)
    gi.cis.sort(key=lambda c: c.id)
    return ci


def mig_uuid(gpu_uuid: str, ci: CiRecord) -> str:
    """The MIG device's UUID: `MIG-` + 8-4-4-4-12 lowercase hex (UUID version 5). New
    for every compute instance created (its serial), as on a GPU: a device created
    again at a placement gets the same GI and CI ids but another UUID."""
    return f"MIG-{uuidlib.uuid5(_MIG_UUID_NAMESPACE, f'{gpu_uuid}/{ci.serial}')}"


# --------------------------------------------------------------------------- capabilities


def mig_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-cap minor of `gpu<minor>/gi<gi>[/ci<ci>]/access` (nv-caps.c numbering).

    The kernel numbers its capability tables in order: nvlink fabric-mgmt 0, MIG
    config 1 and monitor 2, then for gpu0..31, gi0..14: the GI's access, then ci0..7.
    """
    if not (0 <= gpu_minor < CAP_GPUS and 0 <= gi < _CAP_GIS and ci in (None, *range(8))):
        raise ValueError(f"no MIG capability for gpu{gpu_minor}/gi{gi}/ci{ci}")
    base = _CAP_FIRST + (gpu_minor * _CAP_GIS + gi) * (1 + MAX_CIS)
    return base if ci is None else base + 1 + ci


def mig_minors_text() -> str:
    """The content of /proc/driver/nvidia-caps/mig-minors."""
    lines = ["config 1", "monitor 2"]
    for g in range(CAP_GPUS):
        for i in range(_CAP_GIS):
            lines.append(f"gpu{g}/gi{i}/access {mig_minor(g, i)}")
            lines += [f"gpu{g}/gi{i}/ci{c}/access {mig_minor(g, i, c)}" for c in range(MAX_CIS)]
    return "\n".join(lines) + "\n"


def access_text(minor: int, mode: int = _MODE_RUGO) -> str:
    """A capability `access` file: minor, mode (decimal, 0444 = 292), modify flag."""
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"
