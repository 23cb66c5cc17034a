"""Mock fleets: which GPUs a mock node has, described by built-in model profiles.

A fleet file (YAML) names models and counts:

    gpus:
    - model: H100-80GB
      count: 8
      migMode: enabled        # enabled | disabled; default: enabled when MIG-capable
      migInstances:           # optional: MIG devices an administrator pre-created
      - {profile: 1g.10gb, start: 0}
      - {profile: 3g.40gb, start: 4}
    driverVersion: "580.95.05"
    cudaDriverVersion: "13.0"

`migInstances` lists, for every GPU of the group, the GPU instances that exist from
boot (as mig-parted creates them), each with one compute instance covering it. A
`profile` is a MIG profile name of the model (`nvidia-smi mig -lgip`), `start` one of
its possible placements (`nvidia-smi mig -lgipp`, in memory slices); MIG mode must be
enabled and no two instances may overlap or exceed the profile's instance count.

Decoding is strict: unknown fields, wrong types and unknown models are errors that
name the field path. Model profiles (what NVML reports for one GPU of a kind, with its
MIG GPU-instance profile table) are data in `driver/nvml/mock/profiles/models.yaml`.
"""

from __future__ import annotations

import functools
import hashlib
import re
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml

DEFAULT_DRIVER_VERSION = "580.95.05"
DEFAULT_CUDA_DRIVER_VERSION = "13.0"
EXAMPLE_DRIVER_VERSION = "1.0.0"  # what the Go reference publishes
EXAMPLE_MODEL = "example"
BUILTIN_FLEETS = ("default", "example")
MAX_GPUS = 1024
# libyaml's parser where PyYAML was built with it: the built-in models table is parsed
# at every mock start, ten times faster than by the pure-Python one.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_PCI_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)  # DGX-like bus numbers


class FleetError(ValueError):
    """An invalid fleet file or model table; the message names the field path."""


# --------------------------------------------------------------------------- models


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Decoded strictly (`msgspec.convert(..., strict=True)`): no coercion, no unknown
    fields."""


class MigProfileSpec(_Strict, frozen=True):
    name: str
    slot: str  # NVML_GPU_INSTANCE_PROFILE_<slot>
    id: Annotated[int, msgspec.Meta(ge=0)]
    sliceCount: Annotated[int, msgspec.Meta(ge=1)]
    instanceCount: Annotated[int, msgspec.Meta(ge=1)]
    memoryMiB: Annotated[int, msgspec.Meta(ge=1)]
    multiprocessors: Annotated[int, msgspec.Meta(ge=1)]
    copyEngines: Annotated[int, msgspec.Meta(ge=0)]
    decoders: Annotated[int, msgspec.Meta(ge=0)]
    encoders: Annotated[int, msgspec.Meta(ge=0)]
    jpegEngines: Annotated[int, msgspec.Meta(ge=0)]
    ofaEngines: Annotated[int, msgspec.Meta(ge=0)]
    placements: Annotated[tuple[tuple[int, int], ...], msgspec.Meta(min_length=1)]


class MigSpec(_Strict, frozen=True):
    profiles: Annotated[tuple[MigProfileSpec, ...], msgspec.Meta(min_length=1)]

    @property
    def compute_slices(self) -> int:
        """Compute slices of the whole GPU (7 on A100/H100): the largest profile's."""
        return max(p.sliceCount for p in self.profiles)

    def by_name(self, name: str) -> MigProfileSpec | None:
        return next((p for p in self.profiles if p.name == name), None)

    def by_id(self, profile_id: int) -> MigProfileSpec | None:
        return next((p for p in self.profiles if p.id == profile_id), None)


@dataclass(frozen=True)
class MigPlacement:
    """A GPU instance of `profile` at memory slices [start, start + size)."""

    profile: MigProfileSpec
    start: int
    size: int

    def overlaps(self, other: MigPlacement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


def mig_conflict(mig: MigSpec, placed: Sequence[MigPlacement], new: MigPlacement) -> str | None:
    """Why `new` cannot be created next to `placed` on one GPU (None: it can).

    `new.start`/`new.size` must already be one of the profile's possible placements.
    NVML refuses an occupied or overlapping placement, a profile past its instance
    count, and compute slices past the GPU's (INSUFFICIENT_RESOURCES).
    """
    for other in placed:
        if new.overlaps(other):
            return (
                f"{new.profile.name} at {new.start} overlaps {other.profile.name} at {other.start}"
            )
    if sum(1 for p in placed if p.profile.id == new.profile.id) >= new.profile.instanceCount:
        return f"{new.profile.name}: at most {new.profile.instanceCount} instance(s) per GPU"
    if sum(p.profile.sliceCount for p in placed) + new.profile.sliceCount > mig.compute_slices:
        return f"{new.profile.name}: no {new.profile.sliceCount} free compute slice(s)"
    return None


class ModelProfile(_Strict, frozen=True):
    productName: str
    memoryMiB: Annotated[int, msgspec.Meta(ge=1)]
    architecture: str | None = None  # ampere | hopper | ... (NVML_DEVICE_ARCH_<upper>)
    brand: str | None = None  # nvidia | tesla | ... (NVML_BRAND_<upper>)
    cudaComputeCapability: str | None = None
    pciDeviceId: int = 0x000010DE
    mig: MigSpec | None = None
    referenceExample: bool = False

    @property
    def mig_capable(self) -> bool:
        return self.mig is not None


class _ModelTable(_Strict, frozen=True):
    models: dict[str, ModelProfile]


class MigInstanceSpec(_Strict, frozen=True):
    profile: str
    start: Annotated[int, msgspec.Meta(ge=0)]


class FleetGpus(_Strict, frozen=True):
    model: str
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_GPUS)] = 1
    migMode: Literal["enabled", "disabled"] | None = None
    migInstances: tuple[MigInstanceSpec, ...] = ()


class Fleet(_Strict, frozen=True):
    gpus: tuple[FleetGpus, ...]
    driverVersion: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    cudaDriverVersion: Annotated[str, msgspec.Meta(pattern=r"^\d+\.\d+$")] | None = None

    @property
    def resolved_driver_version(self) -> str:
        if self.driverVersion is not None:
            return self.driverVersion
        if all(g.model == EXAMPLE_MODEL for g in self.gpus):
            return EXAMPLE_DRIVER_VERSION
        return DEFAULT_DRIVER_VERSION

    @property
    def resolved_cuda_driver_version(self) -> str:
        return self.cudaDriverVersion or DEFAULT_CUDA_DRIVER_VERSION


def static_mig_placements(group: FleetGpus, model: ModelProfile, path: str) -> list[MigPlacement]:
    """The group's `migInstances` as placements; ValueError naming the field path."""
    if not group.migInstances:
        return []
    if model.mig is None or group.migMode == "disabled":
        raise ValueError(f"{path}.migInstances: MIG mode must be enabled on model {group.model}")
    placed: list[MigPlacement] = []
    for j, spec in enumerate(group.migInstances):
        where = f"{path}.migInstances[{j}]"
        profile = model.mig.by_name(spec.profile)
        if profile is None:
            known = ", ".join(p.name for p in model.mig.profiles)
            raise ValueError(
                f"{where}.profile: unknown MIG profile {spec.profile!r} for model "
                f"{group.model} (known: {known})"
            )
        sizes = {start: size for start, size in profile.placements}
        if spec.start not in sizes:
            starts = ", ".join(str(s) for s in sizes)
            raise ValueError(
                f"{where}.start: {spec.start} is not a possible placement of {profile.name} "
                f"(possible starts: {starts})"
            )
        new = MigPlacement(profile, spec.start, sizes[spec.start])
        conflict = mig_conflict(model.mig, placed, new)
        if conflict is not None:
            raise ValueError(f"{where}: {conflict}")
        placed.append(new)
    return placed


# --------------------------------------------------------------------------- loading


def _check_fleet(fleet: Fleet) -> None:
    """The rules across fields: known models, MIG modes and instances, the GPU count."""
    table = model_profiles()
    if not fleet.gpus:
        raise ValueError("gpus: at least one GPU group is required")
    total = 0
    for i, group in enumerate(fleet.gpus):
        profile = table.get(group.model)
        if profile is None:
            known = ", ".join(sorted(table))
            raise ValueError(f"gpus[{i}].model: unknown model {group.model!r} (known: {known})")
        if group.migMode == "enabled" and not profile.mig_capable:
            raise ValueError(f"gpus[{i}].migMode: model {group.model} is not MIG-capable")
        static_mig_placements(group, profile, f"gpus[{i}]")
        total += group.count
    if total > MAX_GPUS:
        raise ValueError(f"gpus: {total} GPUs exceed the maximum of {MAX_GPUS}")


_MESSAGE = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD = re.compile(r"^Object (?P<kind>contains unknown|missing required) field `(?P<name>[^`]*)`$")

_T = TypeVar("_T")


def _decode(cls: type[_T], data: object) -> _T:
    """`data` as `cls`, strictly; ValueError `<field path>: <problem>` (the first one
    msgspec finds)."""
    try:
        return msgspec.convert(data, type=cls, strict=True)
    except msgspec.ValidationError as err:
        raise ValueError(_problem(str(err))) from err


def _problem(message: str) -> str:
    """msgspec's `<problem> - at `$.gpus[0]`` as `gpus[0].<field>: <problem>`."""
    match = _MESSAGE.match(message)
    what, path = (match["what"], (match["path"] or "").lstrip(".")) if match else (message, "")
    field = _FIELD.match(what)
    if field:
        path = f"{path}.{field['name']}" if path else field["name"]
        what = "unknown field" if field["kind"] == "contains unknown" else "missing required field"
    return f"{path}: {what}" if path else what


@functools.cache
def model_profiles() -> dict[str, ModelProfile]:
    """The built-in model profiles, keyed by model name."""
    text = resources.files("driver.nvml.mock").joinpath("profiles/models.yaml").read_text()
    try:
        table = _decode(_ModelTable, yaml.load(text, Loader=SAFE_LOADER))
    except ValueError as err:
        raise FleetError(f"built-in models.yaml: {err}") from err
    return dict(table.models)


def parse_fleet(data: Any, *, source: str = "fleet") -> Fleet:
    """Validate decoded YAML/JSON data as a fleet; errors name the field path."""
    if not isinstance(data, dict):
        raise FleetError(f"{source}: expected a mapping with a `gpus` list")
    try:
        fleet = _decode(Fleet, data)
        _check_fleet(fleet)
    except ValueError as err:  # a field's problem or a rule across fields, each naming its path
        raise FleetError(f"{source}: {err}") from err
    return fleet


def load_fleet(path: str | Path) -> Fleet:
    """Read and validate a fleet YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise FleetError(f"{p}: cannot read fleet file: {err.strerror or err}") from err
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as err:
        raise FleetError(f"{p}: invalid YAML: {err}") from err
    return parse_fleet(data, source=str(p))


def default_fleet() -> Fleet:
    """The built-in fleet: 8 MIG-capable H100-80GB GPUs with MIG enabled."""
    return parse_fleet({"gpus": [{"model": "H100-80GB", "count": 8}]}, source="default fleet")


def example_fleet(count: int = 8) -> Fleet:
    """The Go reference driver's devices: `count` example GPUs."""
    return parse_fleet({"gpus": [{"model": EXAMPLE_MODEL, "count": count}]}, source="example fleet")


def resolve_fleet(spec: str | Path | None) -> Fleet:
    """A fleet from a file path, or a built-in name (`default`, `example`), or None."""
    if spec is None:
        return default_fleet()
    path = Path(spec)
    if not path.exists() and str(spec) in BUILTIN_FLEETS:
        return default_fleet() if str(spec) == "default" else example_fleet()
    return load_fleet(path)


# --------------------------------------------------------------------------- expansion


@dataclass(frozen=True)
class MockGpu:
    """One GPU of an expanded fleet, as the mock NVML reports it."""

    index: int
    minor: int
    uuid: str
    model: str
    profile: ModelProfile
    mig_enabled: bool
    pci_domain: int
    pci_bus: int
    static_mig: tuple[MigPlacement, ...] = ()  # the group's `migInstances`

    @property
    def pci_bus_id(self) -> str:
        """NVML's busId format: 8-hex-digit domain, upper case."""
        return f"{self.pci_domain:08X}:{self.pci_bus:02X}:00.0"


def mock_gpu_uuid(node_name: str, index: int, prefix: str = "GPU") -> str:
    """A stable UUID per node name and GPU index: `<prefix>-` + 8-4-4-4-12 lowercase hex.

    `GPU-` is NVML's form; `example` GPUs take `gpu-`, the Go reference driver's form.
    The reference derives its values from Go's `math/rand` seeded by a hash of the node
    name; nothing depends on those exact values (its own tests ask only for the same
    UUIDs on a node and different ones across nodes), so they are not reproduced.
    """
    digest = hashlib.sha256(f"{node_name}\x00{index}".encode()).digest()
    return f"{prefix}-{uuidlib.UUID(bytes=digest[:16], version=4)}"


def expand_fleet(fleet: Fleet, node_name: str) -> list[MockGpu]:
    """The fleet's GPUs in NVML index order, with deterministic UUIDs for `node_name`
    (`gpu-...` for `example` GPUs, like the reference driver's; `GPU-...` for others)."""
    table = model_profiles()
    gpus: list[MockGpu] = []
    for group in fleet.gpus:
        profile = table[group.model]
        mig_enabled = profile.mig_capable and group.migMode != "disabled"
        static_mig = tuple(static_mig_placements(group, profile, "gpus"))
        for _ in range(group.count):
            index = len(gpus)
            uuid = mock_gpu_uuid(node_name, index, "gpu" if profile.referenceExample else "GPU")
            gpus.append(
                MockGpu(
                    index=index,
                    minor=index,
                    uuid=uuid,
                    model=group.model,
                    profile=profile,
                    mig_enabled=mig_enabled,
                    pci_domain=index // len(_PCI_BUSES),
                    pci_bus=_PCI_BUSES[index % len(_PCI_BUSES)],
                    static_mig=static_mig,
                )
            )
    return gpus
