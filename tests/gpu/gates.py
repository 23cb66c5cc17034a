"""Which GPU each test of the real-GPU tier runs on, or why it skips: pure functions of
what discovery found, so that the decisions are unit-tested without a GPU
(tests/unit/test_gpu_tier_gates.py).

The tier never changes a GPU's MIG mode and never touches a MIG device it did not
create: a GPU in the wrong mode, or with an administrator's MIG devices, makes the
tests that need another setup skip with one line saying why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from driver.devices.model import MigStrategy, foreign_instances
from driver.nvml.discovered import GpuInfo, Inventory, PartitionProfile

MIG_OFF_HINT = (
    "MIG tests need a GPU an administrator put in MIG mode (this suite never changes MIG mode)"
)


@dataclass(frozen=True)
class Gate:
    """The GPU a group of tests runs on, or (gpu None) why the group skips."""

    gpu: GpuInfo | None
    skip: str | None = None

    def __post_init__(self) -> None:
        if (self.gpu is None) == (self.skip is None):
            raise ValueError("Gate: exactly one of gpu and skip must be set")


def _uuids(gpus: Sequence[GpuInfo]) -> str:
    return ", ".join(g.uuid for g in gpus)


def whole_gpu_gate(gpus: Sequence[GpuInfo]) -> Gate:
    """A GPU with MIG mode off, for the tests that prepare a whole GPU."""
    off = [g for g in gpus if not g.mig_enabled]
    if off:
        return Gate(off[0])
    return Gate(
        None,
        f"every GPU is in MIG mode ({_uuids(gpus)}); the whole-GPU tests need one with "
        "MIG mode off (this suite never changes MIG mode)",
    )


def _mig_gpus(gpus: Sequence[GpuInfo]) -> tuple[list[GpuInfo], str | None]:
    """The GPUs in MIG mode whose profiles NVML reports, or why there are none."""
    on = [g for g in gpus if g.mig_enabled]
    if not on:
        return [], f"MIG mode is off on {_uuids(gpus)}; {MIG_OFF_HINT}"
    usable = [g for g in on if g.partition_profiles]
    if not usable:
        return [], f"MIG mode is on on {_uuids(on)}, but NVML reports no GPU-instance profile"
    return usable, None


def dynamic_mig_gate(gpus: Sequence[GpuInfo]) -> Gate:
    """A GPU in MIG mode without any MIG device, for the dynamic-strategy tests: they
    create MIG devices and destroy what they created, and `--mig-strategy=dynamic`
    refuses a GPU with MIG devices the driver did not create."""
    usable, why = _mig_gpus(gpus)
    if why is not None:
        return Gate(None, why)
    for gpu in usable:
        if not gpu.mig_instances:
            return Gate(gpu)
    found = "; ".join(f"{g.uuid}: {', '.join(foreign_instances(g, frozenset()))}" for g in usable)
    return Gate(
        None,
        f"every GPU in MIG mode has MIG devices this suite did not create ({found}); the "
        "dynamic-strategy tests need one without any and never touch an administrator's "
        "(a GPU instance without a compute instance may be a crashed run's: "
        "nvidia-smi mig -dgi removes it)",
    )


def static_mig_gate(gpus: Sequence[GpuInfo]) -> Gate:
    """A GPU in MIG mode with an administrator's MIG device (a GPU instance with its
    compute instance), for the static test: it is prepared as it is, never destroyed."""
    usable, why = _mig_gpus(gpus)
    if why is not None:
        return Gate(None, why)
    for gpu in usable:
        if any(m.uuid is not None for m in gpu.mig_instances):
            return Gate(gpu)
    return Gate(
        None,
        f"no GPU in MIG mode ({_uuids(usable)}) has a MIG device an administrator created; "
        "the static-strategy test needs one (the dynamic tests create their own)",
    )


def dynamic_strategy(gpus: Sequence[GpuInfo]) -> MigStrategy:
    """The `--mig-strategy` of the dynamic tests' node: `dynamic`, unless a GPU in MIG
    mode has MIG devices the driver did not create (`dynamic` refuses such a node);
    then `auto`, which keeps a GPU without any dynamic (the tests assert it)."""
    if any(g.mig_enabled and g.mig_instances for g in gpus):
        return MigStrategy.AUTO
    return MigStrategy.DYNAMIC


@dataclass(frozen=True)
class TierGates:
    whole_gpu: Gate
    dynamic_mig: Gate
    static_mig: Gate
    dynamic_strategy: MigStrategy

    @classmethod
    def of(cls, gpus: Sequence[GpuInfo]) -> TierGates:
        return cls(
            whole_gpu_gate(gpus),
            dynamic_mig_gate(gpus),
            static_mig_gate(gpus),
            dynamic_strategy(gpus),
        )


def summary_lines(found: Inventory | str) -> list[str]:
    """What `make test-gpu` prints at its end, even with -q: the GPUs found and why any
    group skipped (one line per reason), or, without a GPU, why every test skipped."""
    if isinstance(found, str):
        return [f"real-GPU tier: every test skipped: no NVIDIA GPU on this host: {found}"]
    listed = ", ".join(
        f"{g.minor}:{g.product_name} {g.uuid} MIG={'on' if g.mig_enabled else 'off'}"
        for g in found.gpus
    )
    lines = [f"real-GPU tier: GPUs: {listed}"]
    gates = TierGates.of(found.gpus)
    skipped = {
        "whole-GPU tests": gates.whole_gpu.skip,
        "dynamic MIG tests": gates.dynamic_mig.skip,
        "static MIG test": gates.static_mig.skip,
    }
    reasons: dict[str, list[str]] = {}
    for group, why in skipped.items():
        if why is not None:
            reasons.setdefault(why, []).append(group)
    for why, groups in reasons.items():
        lines.append(f"real-GPU tier: {' and '.join(groups)} skipped: {why}")
    return lines


def smallest_profile(gpu: GpuInfo) -> PartitionProfile:
    """The GPU-instance profile with the fewest slices and least memory, a plain one
    (no `+me`-style extra engines) where there is a choice."""
    if not gpu.partition_profiles:
        raise ValueError(f"GPU {gpu.uuid}: no GPU-instance profile")
    return min(
        gpu.partition_profiles,
        key=lambda p: (p.slice_count, p.memory_bytes, "+" in p.name, p.name),
    )


def disjoint_placements(profile: PartitionProfile, count: int) -> list[tuple[int, int]]:
    """`count` placements of the profile that share no memory slice, lowest first;
    ValueError if the profile has fewer."""
    chosen: list[tuple[int, int]] = []
    for start, size in sorted(profile.placements):
        if all(start >= s + n or s >= start + size for s, n in chosen):
            chosen.append((start, size))
        if len(chosen) == count:
            return chosen
    raise ValueError(
        f"profile {profile.name}: {count} disjoint placements needed, "
        f"{len(chosen)} in {list(profile.placements)}"
    )
