"""The opaque `GpuConfig` API: its values, defaults and device rules (the strict
decoding and static rules are in `driver.config.decode`).

Wire format (identical to the reference driver's)::

    apiVersion: gpu.resource.example.com/v1alpha1
    kind: GpuConfig
    sharing:                       # optional
      strategy: TimeSlicing        # TimeSlicing | SpacePartitioning | MPS (required)
      timeSlicingConfig:           # optional, only with TimeSlicing
        interval: Default          # Default | Short | Medium | Long (optional)
      spacePartitioningConfig:     # optional, only with SpacePartitioning
        partitionCount: 1          # int, 1..64 (MAX_PARTITION_COUNT) (optional)
      mpsConfig:                   # optional, only with MPS (NVIDIA's field names)
        defaultActiveThreadPercentage: 50      # int, 1..100 (optional)
        defaultPinnedDeviceMemoryLimit: 8Gi    # quantity >= 1Mi (optional)
        defaultPerDevicePinnedMemoryLimit:     # optional map: device index or GPU UUID
          "0": 4Gi                             #   -> quantity >= 1Mi

The values are frozen dataclasses. Decoding is strict: unknown fields, duplicate
fields, wrong JSON types (no coercion: `"2"` is not an integer, `true` is not an
integer) are errors. A `null` optional field is treated as absent.

Defaults, applied by `decode_gpu_config` before validation, in the webhook, the
CLI and the plugin alike:
- no `sharing` -> `{strategy: TimeSlicing, timeSlicingConfig: {interval: Default}}`;
- TimeSlicing without any sub-config -> `timeSlicingConfig: {interval: Default}`;
- SpacePartitioning without any sub-config -> `spacePartitioningConfig: {partitionCount: 1}`;
- MPS without any sub-config -> `mpsConfig: {}` (a daemon with MPS's own defaults: all
  threads, no memory limit);
- a given sub-config without its value -> `interval: Default` / `partitionCount: 1`
  (divergence from the reference, which keeps `""` / `0`).

Static rules: known strategy and interval; the sub-config matches the strategy;
never both sub-configs; `1 <= partitionCount <= MAX_PARTITION_COUNT` (64). Unlike the
reference, a config with both sub-configs is rejected at decode time (in the
webhook), not at prepare.

The upper bound on `partitionCount` is a divergence from the reference, which has
none (docs/reliability.md): 64 is far above any real split of one GPU (MIG makes at
most 7 instances); a device's own `maxPartitions` stays the tighter limit.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from driver.config.config_error import ConfigError
from driver.config.loader import join_path

GROUP: Final = "gpu.resource.example.com"
API_VERSION: Final = f"{GROUP}/v1alpha1"
KIND: Final = "GpuConfig"


class Strategy(enum.StrEnum):
    TIME_SLICING = "TimeSlicing"
    SPACE_PARTITIONING = "SpacePartitioning"
    MPS = "MPS"


class Interval(enum.StrEnum):
    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"


DEFAULT_PARTITION_COUNT: Final = 1
#: The most partitions any config may ask for (see the module docstring).
MAX_PARTITION_COUNT: Final = 64
#: The most values (fields, list items, nested objects) a config may hold before it is
#: refused as a whole: a GpuConfig has at most 10 that prepare can accept (the
#: per-device map names one device, by "0" or by UUID). Reporting each unknown field
#: of a config of thousands costs a worker of the webhook seconds.
MAX_CONFIG_VALUES: Final = 256


@dataclass(frozen=True)
class TimeSlicingConfig:
    interval: str | None = None


@dataclass(frozen=True)
class SpacePartitioningConfig:
    partitionCount: int | None = None


class PerDeviceLimits(Mapping[str, str]):
    """`defaultPerDevicePinnedMemoryLimit`: device key (index or GPU UUID) -> quantity
    text. Immutable and hashable like the dataclasses that hold it; `to_dict` writes it
    as a JSON object."""

    __slots__ = ("_limits",)

    def __init__(self, limits: Mapping[str, str] | None = None) -> None:
        self._limits: dict[str, str] = dict(limits or {})

    def __getitem__(self, key: str) -> str:
        return self._limits[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._limits)

    def __len__(self) -> int:
        return len(self._limits)

    def __hash__(self) -> int:
        return hash(frozenset(self._limits.items()))

    def __repr__(self) -> str:
        return f"PerDeviceLimits({self._limits!r})"


@dataclass(frozen=True)
class MpsConfig:
    """The limits the claim's MPS control daemon gives every client (docs/mps.md).
    The memory limits stay the quantity text the user wrote (`memory_limit_bytes`
    parses them)."""

    defaultActiveThreadPercentage: int | None = None
    defaultPinnedDeviceMemoryLimit: str | None = None
    defaultPerDevicePinnedMemoryLimit: PerDeviceLimits | None = None


@dataclass(frozen=True)
class Sharing:
    strategy: str
    timeSlicingConfig: TimeSlicingConfig | None = None
    spacePartitioningConfig: SpacePartitioningConfig | None = None
    mpsConfig: MpsConfig | None = None


@dataclass(frozen=True)
class GpuConfig:
    """A GpuConfig. Values returned by `decode_gpu_config` / `default_gpu_config` are
    defaulted and valid: `sharing` is set and exactly the strategy's sub-config is
    present with its value filled in. Frozen and hashable (usable as a dict key)."""

    apiVersion: str
    kind: str
    sharing: Sharing | None = None

    @property
    def strategy(self) -> Strategy:
        """The sharing strategy (only meaningful on a decoded config)."""
        if self.sharing is None:
            return Strategy.TIME_SLICING
        return Strategy(self.sharing.strategy)

    @property
    def interval(self) -> Interval | None:
        """The time-slice interval for TimeSlicing, else None."""
        sharing = self.sharing
        if sharing is None:
            return Interval.DEFAULT
        if sharing.strategy != Strategy.TIME_SLICING:
            return None
        tsc = sharing.timeSlicingConfig
        if tsc is None or tsc.interval is None:
            return Interval.DEFAULT
        return Interval(tsc.interval)

    @property
    def partition_count(self) -> int | None:
        """The partition count for SpacePartitioning, else None."""
        sharing = self.sharing
        if sharing is None or sharing.strategy != Strategy.SPACE_PARTITIONING:
            return None
        spc = sharing.spacePartitioningConfig
        if spc is None or spc.partitionCount is None:
            return DEFAULT_PARTITION_COUNT
        return spc.partitionCount

    @property
    def mps(self) -> MpsConfig | None:
        """The MPS limits for the MPS strategy, else None."""
        sharing = self.sharing
        if sharing is None or sharing.strategy != Strategy.MPS:
            return None
        return sharing.mpsConfig or MpsConfig()

    def to_dict(self) -> dict[str, Any]:
        """The wire form (JSON-compatible, absent fields omitted)."""
        return dataclasses.asdict(self, dict_factory=_without_none)


def _without_none(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {
        key: dict(value) if isinstance(value, PerDeviceLimits) else value
        for key, value in items
        if value is not None
    }


def default_gpu_config() -> GpuConfig:
    """What a device gets when no config applies: TimeSlicing with the Default interval."""
    return GpuConfig(
        apiVersion=API_VERSION,
        kind=KIND,
        sharing=Sharing(
            strategy=Strategy.TIME_SLICING.value,
            timeSlicingConfig=TimeSlicingConfig(interval=Interval.DEFAULT.value),
        ),
    )


def int_text(value: int) -> str:
    """An integer for a message; a huge one (which `str` may refuse) described instead."""
    if abs(value) < 10**30:
        return str(value)
    return f"{'-' if value < 0 else ''}a number of {value.bit_length()} bits"


def validate_for_device(
    config: GpuConfig,
    *,
    device_name: str,
    is_partition: bool,
    max_partitions: int | None,
    path: str = "",
    share: bool = False,
    no_time_slice: str | None = None,
) -> None:
    """Device rules, checked at prepare for each allocated device.

    - MPS needs a device that runs on a whole GPU, without admin access: the daemon
      serves its GPU (`no_time_slice` says why the device has none).
    - A non-Default time-slice interval needs a device whose GPU's interval this
      driver sets (docs/sharing.md, "Time-slice intervals"): `no_time_slice` says why
      the device has none ("a MIG device: ...", "with admin access"), and then the
      interval is refused rather than passed to the container as if it were applied.
    - SpacePartitioning is not possible on a share of a multi-allocatable device
      (`share`: the allocation has a shareID; docs/sharing.md): the share is a slice
      of a time-sliced GPU, not a GPU to split. TimeSlicing is allowed on a share.
    - SpacePartitioning is not possible on a device that is itself a partition.
    - `partitionCount` must be <= `max_partitions` (the device's `maxPartitions`);
      `max_partitions=None` means the device publishes no limit (the reference's
      `example` devices): then `MAX_PARTITION_COUNT` is the limit (a decoded config
      never exceeds it; this guards configs built in code).

    Raises `ConfigError` (permanent invalid-config, "impossible partition count")
    whose message names the device and the numbers. `path` prefixes the field path.
    """
    strategy, interval, count = config.strategy, config.interval, config.partition_count
    field = "strategy"  # under `<path>.sharing`
    message: str | None = None
    if no_time_slice is not None and strategy == Strategy.MPS:
        message = (
            f"MPS is not possible on device {device_name} ({no_time_slice}); "
            "use a GPU with MIG mode off, without admin access"
        )
    elif no_time_slice is not None and interval not in (None, Interval.DEFAULT):
        field = "timeSlicingConfig.interval"
        message = (
            f"cannot set the time-slice interval {interval} of device {device_name} "
            f"({no_time_slice}); nothing would apply it. Use a GPU with MIG mode "
            "off, or no interval (Default)"
        )
    elif share and strategy == Strategy.SPACE_PARTITIONING:
        message = (
            f"SpacePartitioning is not possible on a share of device {device_name} "
            "(allocated by consumable capacity); use TimeSlicing or no sharing config"
        )
    elif strategy == Strategy.SPACE_PARTITIONING and count is not None:
        field = "spacePartitioningConfig.partitionCount"
        limit = max_partitions if max_partitions is not None else MAX_PARTITION_COUNT
        if is_partition:
            message = (
                f"impossible partition count: device {device_name} is itself a partition "
                f"and cannot be space-partitioned (partitionCount {count})"
            )
        elif count > limit:
            message = (
                f"impossible partition count: device {device_name} supports at most "
                f"{limit} partitions, config requests {int_text(count)}"
            )
    if message is not None:
        raise ConfigError([(join_path(path, f"sharing.{field}"), message)])
