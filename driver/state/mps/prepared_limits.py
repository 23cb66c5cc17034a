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
from driver.config.loader import join_key
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
_MPS_FIELD: Final = "sharing.mpsConfig"  # where a GpuConfig's MPS limits are


@dataclass(frozen=True)
class MpsLimits:
    """What the daemon enforces for every client; None: MPS's own default (no limit)."""

    active_thread_percentage: int | None = None
    pinned_memory_bytes: int | None = None


def _whole_mib(memory: int) -> int:
    """MPS's unit: whole MiB, rounded down, at least one."""
    return max(MIB, memory - memory % MIB)


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
        """Its memory in whole MiB; None for all of it (or unknown)."""
        if self.memory is None or self.gpu_memory is None or self.memory >= self.gpu_memory:
            return None
        return _whole_mib(self.memory)

    @property
    def whole(self) -> bool:
        """Nothing of the GPU is left for another allocation, so there is nothing to
        enforce: less than the smallest share of memory or of compute (a share that asks
        for memory only consumes the default, all, of the compute)."""
        left = [
            (total - given, step)
            for total, given, step in (
                (self.gpu_memory, self.memory, SHARE_MEMORY_STEP),
                (self.gpu_compute, self.compute, SHARE_COMPUTE_STEP),
            )
            if total is not None and given is not None
        ]
        return not left or any(rest < step for rest, step in left)


def _capacity(document: Mapping[str, Any], name: str) -> int | None:
    entry = (document.get("capacity") or {}).get(name)
    if not isinstance(entry, Mapping) or "value" not in entry:
        return None
    return int(parse_quantity(entry["value"]))


def allotment(
    device: PreparableDevice,
    devices: Mapping[str, PreparableDevice],
    consumed: Mapping[str, Any],
) -> Allotment:
    """What the allocation of `device` (`consumed`: a share's `consumedCapacity`, empty
    for an exclusive allocation) is given of its GPU; `devices`: the node's pool."""
    whole_gpu = next(  # `gpu-<i>`, `gpu-<i>-full`
        (
            d
            for d in devices.values()
            if d.gpu_uuid == device.gpu_uuid and not d.is_partition and d.mig is None
        ),
        device,
    )

    def given(name: str) -> int | None:
        if name in consumed:
            return int(parse_quantity(consumed[name]))
        return _capacity(device.document, name)

    return Allotment(
        memory=given("memory"),
        compute=given("compute"),
        gpu_memory=_capacity(whole_gpu.document, "memory"),
        gpu_compute=_capacity(whole_gpu.document, "compute"),
    )


def _key_error(key: str, device_name: str, gpu_uuid: str) -> str | None:
    """Why a (decoded) key of `defaultPerDevicePinnedMemoryLimit` is not the device's."""
    if key == "0" or key.lower() == gpu_uuid.lower():
        return None
    if is_device_index(key):
        return (
            f"the MPS daemon of device {device_name} serves one GPU, which its clients see "
            "as device 0; use 0 or the GPU's UUID"
        )
    return (
        f"not the GPU of device {device_name} ({gpu_uuid}), the one its MPS daemon serves; "
        "use its UUID or 0"
    )


def _pinned_limit(mps: MpsConfig, device_name: str, gpu_uuid: str) -> tuple[str, str] | None:
    """(the field that sets it, its text): the device's entry of
    `defaultPerDevicePinnedMemoryLimit`, else `defaultPinnedDeviceMemoryLimit`, else
    None. A key that names another device, or a second key for this one, is a
    permanent invalid-config error."""
    per_device = f"{_MPS_FIELD}.defaultPerDevicePinnedMemoryLimit"
    errors: list[tuple[str, str]] = []
    chosen: tuple[str, str] | None = None  # (key, its limit)
    for key, text in (mps.defaultPerDevicePinnedMemoryLimit or {}).items():
        problem = _key_error(key, device_name, gpu_uuid)
        if problem is None and chosen is not None:
            problem = f"names device {device_name}, as key {chosen[0]} does; give one of them"
        if problem is None:
            chosen = (key, text)
        else:
            errors.append((join_key(per_device, key), problem))
    if errors:
        raise ConfigError(errors)
    if chosen is not None:
        return join_key(per_device, chosen[0]), chosen[1]
    if mps.defaultPinnedDeviceMemoryLimit is not None:
        return f"{_MPS_FIELD}.defaultPinnedDeviceMemoryLimit", mps.defaultPinnedDeviceMemoryLimit
    return None


def _configured(config: GpuConfig, given: Allotment, device_name: str, gpu_uuid: str) -> MpsLimits:
    """An `MPS` config's limits for the device; on a share or partition bounded by (and
    defaulting to) what the allocation was given."""
    assert config.mps is not None
    percentage = config.mps.defaultActiveThreadPercentage
    pinned = _pinned_limit(config.mps, device_name, gpu_uuid)
    memory = memory_limit_bytes(pinned[1]) if pinned is not None else None
    if given.whole:
        return MpsLimits(percentage, memory)
    errors: list[tuple[str, str]] = []
    if given.percentage is not None:
        if percentage is not None and percentage > given.percentage:
            errors.append(
                (
                    f"{_MPS_FIELD}.defaultActiveThreadPercentage",
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
                    pinned[0],
                    f"{pinned[1]} is more than the {given.memory_limit >> 20}Mi of memory "
                    f"allocated with device {device_name}",
                )
            )
        memory = memory if memory is not None else given.memory_limit
    if errors:
        raise ConfigError(errors)
    return MpsLimits(percentage, memory)


def mps_limits(
    config: GpuConfig, given: Allotment | None, *, device_name: str, gpu_uuid: str
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
                        "sharing.strategy",
                        "MPS is not available on this node: it is not enabled "
                        "(--mps-daemons) or there is no nvidia-cuda-mps-control in its "
                        "driver root",
                    )
                ]
            )
        return _configured(config, given, device_name, gpu_uuid)
    if given is None:
        return None
    count = config.partition_count
    if count is not None and count > 1:  # SpacePartitioning: 1/count of the GPU
        memory = _whole_mib(given.gpu_memory // count) if given.gpu_memory is not None else None
        percentage = max(MIN_ACTIVE_THREAD_PERCENTAGE, MAX_ACTIVE_THREAD_PERCENTAGE // count)
        return MpsLimits(percentage, memory)
    if given.whole:
        return None
    return MpsLimits(given.percentage, given.memory_limit)
