"""The opaque `GpuConfig` API: strict decoding, defaults, static and device rules.

Wire format (identical to the reference driver's)::

    apiVersion: gpu.resource.example.com/v1alpha1
    kind: GpuConfig
    sharing:                       # optional
      strategy: TimeSlicing        # TimeSlicing | SpacePartitioning (required in sharing)
      timeSlicingConfig:           # optional, only with TimeSlicing
        interval: Default          # Default | Short | Medium | Long (optional)
      spacePartitioningConfig:     # optional, only with SpacePartitioning
        partitionCount: 1          # int, 1..64 (MAX_PARTITION_COUNT) (optional)

Decoding is strict: unknown fields, duplicate fields, wrong JSON types (no
coercion: `"2"` is not an integer, `true` is not an integer) are errors. A `null`
optional field is treated as absent.

Defaults, applied by `decode_gpu_config` before validation, in the webhook, the
CLI and the plugin alike:
- no `sharing` -> `{strategy: TimeSlicing, timeSlicingConfig: {interval: Default}}`;
- TimeSlicing without any sub-config -> `timeSlicingConfig: {interval: Default}`;
- SpacePartitioning without any sub-config -> `spacePartitioningConfig: {partitionCount: 1}`;
- a given sub-config without its value -> `interval: Default` / `partitionCount: 1`
  (divergence from the reference, which keeps `""` / `0`).

Static rules: known strategy and interval; the sub-config matches the strategy;
never both sub-configs; `1 <= partitionCount <= MAX_PARTITION_COUNT` (64). Unlike the
reference, a config with both sub-configs is rejected at decode time (in the
webhook), not at prepare.

The upper bound on `partitionCount` is a divergence from the reference, which has
none: a device that publishes `maxPartitions` is checked against it at prepare, but
one that does not (the reference's example GPUs) took any count, 10^30 included,
straight into its container's env. 64 is far above any real split of one GPU (MIG
makes at most 7 instances); a device's own `maxPartitions` stays the tighter limit.
"""

from __future__ import annotations

import enum
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, ValidationError

from driver.config.errors import ConfigError, FieldError
from driver.config.loader import (
    LoadError,
    exceeds_values,
    find_raw_problems,
    join_path,
    loads_json_or_yaml,
)

GROUP: Final = "gpu.resource.example.com"
API_VERSION: Final = f"{GROUP}/v1alpha1"
KIND: Final = "GpuConfig"


class Strategy(enum.StrEnum):
    TIME_SLICING = "TimeSlicing"
    SPACE_PARTITIONING = "SpacePartitioning"


class Interval(enum.StrEnum):
    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"


DEFAULT_PARTITION_COUNT: Final = 1
#: The most partitions any config may ask for (see the module docstring).
MAX_PARTITION_COUNT: Final = 64
#: The most values (fields, list items, nested objects) a config may hold before it is
#: refused as a whole: a GpuConfig has at most 7. Reporting each unknown field of a
#: config of thousands costs a worker of the webhook seconds.
MAX_CONFIG_VALUES: Final = 256

_MODEL_CONFIG = ConfigDict(strict=True, extra="forbid", frozen=True)


class TimeSlicingConfig(BaseModel):
    model_config = _MODEL_CONFIG

    interval: str | None = None


class SpacePartitioningConfig(BaseModel):
    model_config = _MODEL_CONFIG

    partitionCount: int | None = None


class Sharing(BaseModel):
    model_config = _MODEL_CONFIG

    strategy: str
    timeSlicingConfig: TimeSlicingConfig | None = None
    spacePartitioningConfig: SpacePartitioningConfig | None = None


class GpuConfig(BaseModel):
    """A GpuConfig. Values returned by `decode_gpu_config` / `default_gpu_config` are
    defaulted and valid: `sharing` is set and exactly the strategy's sub-config is
    present with its value filled in. Frozen and hashable (usable as a dict key)."""

    model_config = _MODEL_CONFIG

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

    def to_dict(self) -> dict[str, Any]:
        """The wire form (JSON-compatible, absent fields omitted)."""
        return self.model_dump(exclude_none=True)


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


_TYPE_MESSAGES: Final = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "string_type": "must be a string",
    "model_type": "must be an object",
    "dict_type": "must be an object",
    "model_attributes_type": "must be an object",
    "missing": "required field missing",
    "extra_forbidden": "unknown field",
    "invalid_key": "field names must be strings",
}


def _pydantic_errors(err: ValidationError, path: str) -> list[FieldError]:
    out: list[FieldError] = []
    for item in err.errors(include_url=False):
        where = path
        for part in item["loc"]:
            where = join_path(where, part if isinstance(part, int) else str(part))
        message = _TYPE_MESSAGES.get(item["type"], item["msg"])
        out.append(FieldError(where, message))
    return out


def _normalize(config: GpuConfig) -> GpuConfig:
    """Fill in defaults. Never adds a sub-config next to an existing one, so a config
    with the wrong sub-config is reported as such instead of as "both"."""
    sharing = config.sharing
    if sharing is None:
        return config.model_copy(update={"sharing": default_gpu_config().sharing})
    tsc, spc = sharing.timeSlicingConfig, sharing.spacePartitioningConfig
    if tsc is None and spc is None:
        if sharing.strategy == Strategy.TIME_SLICING:
            tsc = TimeSlicingConfig()
        elif sharing.strategy == Strategy.SPACE_PARTITIONING:
            spc = SpacePartitioningConfig()
    if tsc is not None and tsc.interval is None:
        tsc = TimeSlicingConfig(interval=Interval.DEFAULT.value)
    if spc is not None and spc.partitionCount is None:
        spc = SpacePartitioningConfig(partitionCount=DEFAULT_PARTITION_COUNT)
    return config.model_copy(
        update={
            "sharing": Sharing(
                strategy=sharing.strategy, timeSlicingConfig=tsc, spacePartitioningConfig=spc
            )
        }
    )


def _int(value: int) -> str:
    """An integer for a message; a huge one (which `str` may refuse) described instead."""
    if abs(value) < 10**30:
        return str(value)
    return f"{'-' if value < 0 else ''}a number of {value.bit_length()} bits"


def _one_of(values: type[enum.StrEnum]) -> str:
    return ", ".join(v.value for v in values)


def _static_errors(config: GpuConfig, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    if config.apiVersion != API_VERSION:
        errors.append(
            FieldError(
                join_path(path, "apiVersion"),
                f"unsupported apiVersion {config.apiVersion!r}, expected {API_VERSION!r}",
            )
        )
    if config.kind != KIND:
        errors.append(
            FieldError(
                join_path(path, "kind"), f"unsupported kind {config.kind!r}, expected {KIND!r}"
            )
        )
    sharing = config.sharing
    if sharing is None:  # not reachable after _normalize; kept for direct callers
        return errors
    sharing_path = join_path(path, "sharing")
    tsc, spc = sharing.timeSlicingConfig, sharing.spacePartitioningConfig
    tsc_path = join_path(sharing_path, "timeSlicingConfig")
    spc_path = join_path(sharing_path, "spacePartitioningConfig")
    known = sharing.strategy in Strategy.__members__.values()
    if not known:
        errors.append(
            FieldError(
                join_path(sharing_path, "strategy"),
                f"unknown GPU sharing strategy: {sharing.strategy!r} "
                f"(must be one of {_one_of(Strategy)})",
            )
        )
    if tsc is not None and tsc.interval not in Interval.__members__.values():
        errors.append(
            FieldError(
                join_path(tsc_path, "interval"),
                f"unknown time-slice interval: {tsc.interval!r} "
                f"(must be one of {_one_of(Interval)})",
            )
        )
    count = spc.partitionCount if spc is not None else None
    if count is not None and count < 1:
        errors.append(
            FieldError(join_path(spc_path, "partitionCount"), f"must be >= 1, got {_int(count)}")
        )
    elif count is not None and count > MAX_PARTITION_COUNT:
        errors.append(
            FieldError(
                join_path(spc_path, "partitionCount"),
                f"must be <= {MAX_PARTITION_COUNT}, got {_int(count)}",
            )
        )
    if tsc is not None and spc is not None:
        errors.append(
            FieldError(
                sharing_path,
                "timeSlicingConfig and spacePartitioningConfig are mutually exclusive",
            )
        )
    elif known and tsc is not None and sharing.strategy != Strategy.TIME_SLICING:
        errors.append(FieldError(tsc_path, f"not allowed with strategy {sharing.strategy}"))
    elif known and spc is not None and sharing.strategy != Strategy.SPACE_PARTITIONING:
        errors.append(FieldError(spc_path, f"not allowed with strategy {sharing.strategy}"))
    return errors


def gpu_config_errors(
    parameters: object, path: str = ""
) -> tuple[GpuConfig | None, list[FieldError]]:
    """Decode, default and statically validate; return (config, []) or (None, errors).

    `parameters` is an already-parsed JSON value (ideally loaded with
    `driver.config.loader`, so duplicate keys are known) or raw JSON/YAML text
    (str/bytes). `path` prefixes every error path, e.g.
    `spec.devices.config[0].opaque.parameters`. Never raises for any input.
    """
    if isinstance(parameters, str | bytes | bytearray):
        try:
            parameters = loads_json_or_yaml(parameters)
        except LoadError as err:
            return None, [FieldError(path, str(err))]
    if not isinstance(parameters, dict):
        return None, [FieldError(path, "must be an object")]
    if exceeds_values(parameters, MAX_CONFIG_VALUES):
        return None, [FieldError(path, f"too large: more than {MAX_CONFIG_VALUES} values")]
    errors = find_raw_problems(parameters, path)
    try:
        raw = GpuConfig.model_validate(parameters)
    except ValidationError as err:
        errors.extend(_pydantic_errors(err, path))
        return None, _dedupe(errors)
    except RecursionError:
        return None, [*errors, FieldError(path, "too deeply nested")]
    if errors:
        return None, _dedupe(errors)
    config = _normalize(raw)
    errors = _static_errors(config, path)
    if errors:
        return None, errors
    return config, []


def _dedupe(errors: list[FieldError]) -> list[FieldError]:
    return list(dict.fromkeys(errors))


def decode_gpu_config(parameters: object, path: str = "") -> GpuConfig:
    """Decode, default and statically validate one GpuConfig; raise `ConfigError`
    (permanent invalid-config) naming every bad field. See `gpu_config_errors`."""
    config, errors = gpu_config_errors(parameters, path)
    if config is None:
        raise ConfigError(errors)
    return config


def validate_for_device(
    config: GpuConfig,
    *,
    device_name: str,
    is_partition: bool,
    max_partitions: int | None,
    path: str = "",
    share: bool = False,
) -> None:
    """Device rules, checked at prepare for each allocated device.

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
    count = config.partition_count
    if share and config.strategy == Strategy.SPACE_PARTITIONING:
        raise ConfigError(
            [
                (
                    join_path(join_path(path, "sharing"), "strategy"),
                    f"SpacePartitioning is not possible on a share of device {device_name} "
                    "(allocated by consumable capacity); use TimeSlicing or no sharing config",
                )
            ]
        )
    if config.strategy != Strategy.SPACE_PARTITIONING or count is None:
        return
    field = join_path(
        join_path(join_path(path, "sharing"), "spacePartitioningConfig"), "partitionCount"
    )
    if is_partition:
        raise ConfigError(
            [
                (
                    field,
                    f"impossible partition count: device {device_name} is itself a partition "
                    f"and cannot be space-partitioned (partitionCount {count})",
                )
            ]
        )
    limit = max_partitions if max_partitions is not None else MAX_PARTITION_COUNT
    if count > limit:
        raise ConfigError(
            [
                (
                    field,
                    f"impossible partition count: device {device_name} supports at most "
                    f"{limit} partitions, config requests {_int(count)}",
                )
            ]
        )
