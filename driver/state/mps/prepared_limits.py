"""The MPS limits a device is prepared with (pure; docs/sharing.md, "Enforced through
MPS").

On a node that runs MPS daemons, what an allocation is given of a GPU with MIG off is
enforced by an MPS daemon of its own instead of being passed on as a hint:

- a capacity share (`consumedCapacity`) or a `--gpu-partitions` partition: its memory
  as the pinned device-memory limit, its compute as the share of the GPU's SMs
  (active-thread percentage, rounded down, at least 1);
- `SpacePartitioning` with `partitionCount: n` on a whole GPU: 1/n of the GPU's memory
  and of its SMs for every process of the claim;
- the `MPS` strategy: the limits of its `mpsConfig`; on a share or partition, what the
  config leaves out is the allocation's, and a limit above the allocation is an error.
  The device's daemon serves one GPU, its clients' CUDA device 0: the entry of
  `defaultPerDevicePinnedMemoryLimit` keyed "0" or by the GPU's UUID overrides
  `defaultPinnedDeviceMemoryLimit`, and a key naming any other device is an error.

A whole GPU with another strategy gets no daemon: there is nothing to enforce.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from driver.config import ConfigError, GpuConfig, Strategy
from driver.config.gpu import MpsConfig
from driver.config.loader import join_key, join_path
from driver.config.mps_limits import (
    MAX_ACTIVE_THREAD_PERCENTAGE,
    MIB,
    is_device_index,
    memory_limit_bytes,
)
from driver.devices.formatting import parse_quantity
from driver.devices.model import SHARE_COMPUTE_STEP, SHARE_MEMORY_STEP
from driver.state.request import PreparableDevice

MIN_ACTIVE_THREAD_PERCENTAGE: Final = 1


@dataclass(frozen=True)
class MpsLimits:
    """What the daemon enforces for every client; None: MPS's own default (no limit)."""

    active_thread_percentage: int | None = None
    pinned_memory_bytes: int | None = None


@dataclass(frozen=True)
class Allotment:
    """What an allocation is given of its GPU: memory in bytes and `compute` in the
    published capacity's units, next to the whole GPU's (None: not published)."""

    memory: int | None
    compute: int | None
    gpu_memory: int | None
    gpu_compute: int | None

    @property
    def percentage(self) -> int | None:
        """Its compute as a share of the GPU's SMs; None for all of them (or unknown)."""
        if self.compute is None or not self.gpu_compute or self.compute >= self.gpu_compute:
            return None
        return max(MIN_ACTIVE_THREAD_PERCENTAGE, self.compute * 100 // self.gpu_compute)

    @property
    def memory_limit(self) -> int | None:
        """Its memory in whole MiB (MPS's unit, rounded down); None for all of it (or
        unknown)."""
        if self.memory is None or self.gpu_memory is None or self.memory >= self.gpu_memory:
            return None
        return max(MIB, self.memory - self.memory % MIB)

    @property
    def whole(self) -> bool:
        """Nothing of the GPU is left for another allocation, so there is nothing to
        enforce: less than the smallest share of memory or of compute (a share that asks
        for memory only consumes the default, all, of the compute)."""
        memory_left = _left(self.gpu_memory, self.memory)
        compute_left = _left(self.gpu_compute, self.compute)
        if memory_left is None and compute_left is None:
            return True
        return (memory_left is not None and memory_left < SHARE_MEMORY_STEP) or (
            compute_left is not None and compute_left < SHARE_COMPUTE_STEP
        )


def _left(total: int | None, given: int | None) -> int | None:
    return None if total is None or given is None else total - given


def _capacity(document: Mapping[str, Any], name: str) -> int | None:
    entry = (document.get("capacity") or {}).get(name)
    if not isinstance(entry, Mapping) or "value" not in entry:
        return None
    return int(parse_quantity(entry["value"]))


def _whole_gpu(
    device: PreparableDevice, devices: Mapping[str, PreparableDevice]
) -> PreparableDevice:
    """The device that is the whole of `device`'s GPU (`gpu-<i>`, `gpu-<i>-full`)."""
    for candidate in devices.values():
        if (
            candidate.gpu_uuid == device.gpu_uuid
            and not candidate.is_partition
            and candidate.mig is None
        ):
            return candidate
    return device


def allotment(
    device: PreparableDevice,
    devices: Mapping[str, PreparableDevice],
    consumed: Mapping[str, Any],
) -> Allotment:
    """What the allocation of `device` (`consumed`: a share's `consumedCapacity`, empty
    for an exclusive allocation) is given of its GPU; `devices`: the node's pool."""
    gpu = _whole_gpu(device, devices).document

    def given(name: str) -> int | None:
        if name in consumed:
            return int(parse_quantity(consumed[name]))
        return _capacity(device.document, name)

    return Allotment(
        memory=given("memory"),
        compute=given("compute"),
        gpu_memory=_capacity(gpu, "memory"),
        gpu_compute=_capacity(gpu, "compute"),
    )


def _mps_field(path: str, name: str) -> str:
    return join_path(join_path(join_path(path, "sharing"), "mpsConfig"), name)


@dataclass(frozen=True)
class _PinnedLimit:
    """The pinned limit a config gives the device: the field that set it and its text."""

    field: str
    text: str


def _key_error(key: str, device_name: str, gpu_uuid: str) -> str | None:
    """Why a (decoded) key of `defaultPerDevicePinnedMemoryLimit` is not the device's."""
    if is_device_index(key):
        if key == "0":
            return None
        return (
            f"the MPS daemon of device {device_name} serves one GPU, which its clients see "
            "as device 0; use 0 or the GPU's UUID"
        )
    if key.lower() == gpu_uuid.lower():
        return None
    return (
        f"not the GPU of device {device_name} ({gpu_uuid}), the one its MPS daemon serves; "
        "use its UUID or 0"
    )


def _pinned_limit(
    mps: MpsConfig, device_name: str, gpu_uuid: str, path: str
) -> _PinnedLimit | None:
    """The device's entry of `defaultPerDevicePinnedMemoryLimit`, else
    `defaultPinnedDeviceMemoryLimit`, else None. A key that names another device, or a
    second key for this one, is a permanent invalid-config error."""
    per_device = _mps_field(path, "defaultPerDevicePinnedMemoryLimit")
    errors: list[tuple[str, str]] = []
    chosen: tuple[str, _PinnedLimit] | None = None  # (key, its limit)
    for key, text in (mps.defaultPerDevicePinnedMemoryLimit or {}).items():
        problem = _key_error(key, device_name, gpu_uuid)
        if problem is None and chosen is not None:
            problem = f"names device {device_name}, as key {chosen[0]} does; give one of them"
        if problem is None:
            chosen = (key, _PinnedLimit(join_key(per_device, key), text))
        else:
            errors.append((join_key(per_device, key), problem))
    if errors:
        raise ConfigError(errors)
    if chosen is not None:
        return chosen[1]
    if mps.defaultPinnedDeviceMemoryLimit is not None:
        return _PinnedLimit(
            _mps_field(path, "defaultPinnedDeviceMemoryLimit"), mps.defaultPinnedDeviceMemoryLimit
        )
    return None


def _configured(
    config: GpuConfig, given: Allotment, device_name: str, gpu_uuid: str, path: str
) -> MpsLimits:
    """An `MPS` config's limits for the device; on a share or partition bounded by (and
    defaulting to) what the allocation was given."""
    mps = config.mps
    assert mps is not None
    percentage = mps.defaultActiveThreadPercentage
    pinned = _pinned_limit(mps, device_name, gpu_uuid, path)
    memory = memory_limit_bytes(pinned.text) if pinned is not None else None
    errors: list[tuple[str, str]] = []
    if given.whole:
        return MpsLimits(percentage, memory)
    if given.percentage is not None:
        if percentage is not None and percentage > given.percentage:
            errors.append(
                (
                    _mps_field(path, "defaultActiveThreadPercentage"),
                    f"{percentage} is more than the {given.percentage}% of the GPU's SMs "
                    f"allocated with device {device_name} (compute {given.compute} of "
                    f"{given.gpu_compute})",
                )
            )
        percentage = percentage if percentage is not None else given.percentage
    if given.memory_limit is not None:
        if pinned is not None and memory is not None and memory > given.memory_limit:
            errors.append(
                (
                    pinned.field,
                    f"{pinned.text} is more than the "
                    f"{given.memory_limit >> 20}Mi of memory allocated with "
                    f"device {device_name}",
                )
            )
        memory = memory if memory is not None else given.memory_limit
    if errors:
        raise ConfigError(errors)
    return MpsLimits(percentage, memory)


def _split(count: int, given: Allotment) -> MpsLimits:
    """1/count of the GPU for SpacePartitioning."""
    memory = None
    if given.gpu_memory is not None:
        part = given.gpu_memory // count
        memory = max(MIB, part - part % MIB)
    return MpsLimits(
        max(MIN_ACTIVE_THREAD_PERCENTAGE, MAX_ACTIVE_THREAD_PERCENTAGE // count), memory
    )


def mps_limits(
    config: GpuConfig,
    given: Allotment | None,
    *,
    device_name: str,
    gpu_uuid: str,
    path: str = "",
) -> MpsLimits | None:
    """The limits of the device's daemon, None for no daemon. `gpu_uuid`: the GPU the
    daemon would serve. `given`: what the allocation is given of it, None where this node
    runs no MPS daemon for the device; then only the `MPS` strategy is refused
    (permanent invalid-config) and everything else stays advisory."""
    if config.strategy == Strategy.MPS:
        if given is None:
            raise ConfigError(
                [
                    (
                        join_path(join_path(path, "sharing"), "strategy"),
                        "MPS is not available on this node: it is not enabled "
                        "(--mps-daemons) or there is no nvidia-cuda-mps-control in its "
                        "driver root",
                    )
                ]
            )
        return _configured(config, given, device_name, gpu_uuid, path)
    if given is None:
        return None
    count = config.partition_count
    if count is not None and count > 1:
        return _split(count, given)
    if given.whole:
        return None
    return MpsLimits(given.percentage, given.memory_limit)
