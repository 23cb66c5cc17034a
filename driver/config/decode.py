"""Strict decoding of an opaque GpuConfig (`driver.config.gpu` has the wire format):
pydantic models check the JSON types and fields, then defaults and the static rules
apply. Imported on first use (`driver.config` loads it lazily): the plugin's start and
its prepares of claims without opaque config never pay for pydantic.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from pydantic import BaseModel, ConfigDict, ValidationError

from driver.config.config_error import ConfigError, FieldError
from driver.config.gpu import (
    API_VERSION,
    DEFAULT_PARTITION_COUNT,
    KIND,
    MAX_CONFIG_VALUES,
    MAX_PARTITION_COUNT,
    GpuConfig,
    Interval,
    MpsConfig,
    PerDeviceLimits,
    Sharing,
    SpacePartitioningConfig,
    Strategy,
    TimeSlicingConfig,
    default_gpu_config,
    int_text,
)
from driver.config.loader import (
    KEY_NOT_A_STRING,
    LoadError,
    exceeds_values,
    find_raw_problems,
    join_key,
    join_path,
)
from driver.config.mps_limits import (
    MAX_ACTIVE_THREAD_PERCENTAGE,
    device_key_error,
    memory_limit_bytes,
)
from driver.config.yaml_loader import loads_json_or_yaml


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _TimeSlicingModel(_Model):
    interval: str | None = None


class _SpacePartitioningModel(_Model):
    partitionCount: int | None = None


class _MpsModel(_Model):
    defaultActiveThreadPercentage: int | None = None
    defaultPinnedDeviceMemoryLimit: str | None = None
    defaultPerDevicePinnedMemoryLimit: dict[str, str] | None = None


#: Fields whose value is a map keyed by data: error paths write its keys `field[key]`.
_MAP_FIELDS: Final = frozenset({"defaultPerDevicePinnedMemoryLimit"})


class _SharingModel(_Model):
    strategy: str
    timeSlicingConfig: _TimeSlicingModel | None = None
    spacePartitioningConfig: _SpacePartitioningModel | None = None
    mpsConfig: _MpsModel | None = None


class _GpuConfigModel(_Model):
    apiVersion: str
    kind: str
    sharing: _SharingModel | None = None


def _as_config(model: _GpuConfigModel) -> GpuConfig:
    sharing = model.sharing
    if sharing is None:
        return GpuConfig(model.apiVersion, model.kind)
    tsc, spc, mps = sharing.timeSlicingConfig, sharing.spacePartitioningConfig, sharing.mpsConfig
    limits = None if mps is None else mps.defaultPerDevicePinnedMemoryLimit
    return GpuConfig(
        model.apiVersion,
        model.kind,
        Sharing(
            sharing.strategy,
            None if tsc is None else TimeSlicingConfig(tsc.interval),
            None if spc is None else SpacePartitioningConfig(spc.partitionCount),
            None
            if mps is None
            else MpsConfig(
                mps.defaultActiveThreadPercentage,
                mps.defaultPinnedDeviceMemoryLimit,
                None if limits is None else PerDeviceLimits(limits),
            ),
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
        where, previous = path, None
        message = _TYPE_MESSAGES.get(item["type"], item["msg"])
        for part in item["loc"]:
            if part == "[key]":  # pydantic's marker: the key itself is wrong
                message = KEY_NOT_A_STRING
            elif previous in _MAP_FIELDS:
                where = join_key(where, part)
            else:
                where = join_path(where, part if isinstance(part, int) else str(part))
            previous = part
        out.append(FieldError(where, message))
    return out


def _normalize(config: GpuConfig) -> GpuConfig:
    """Fill in defaults. Never adds a sub-config next to an existing one, so a config
    with the wrong sub-config is reported as such instead of as "both"."""
    sharing = config.sharing
    if sharing is None:
        return dataclasses.replace(config, sharing=default_gpu_config().sharing)
    tsc, spc, mps = sharing.timeSlicingConfig, sharing.spacePartitioningConfig, sharing.mpsConfig
    if tsc is None and spc is None and mps is None:
        if sharing.strategy == Strategy.TIME_SLICING:
            tsc = TimeSlicingConfig()
        elif sharing.strategy == Strategy.SPACE_PARTITIONING:
            spc = SpacePartitioningConfig()
        elif sharing.strategy == Strategy.MPS:
            mps = MpsConfig()
    if tsc is not None and tsc.interval is None:
        tsc = TimeSlicingConfig(interval=Interval.DEFAULT.value)
    if spc is not None and spc.partitionCount is None:
        spc = SpacePartitioningConfig(partitionCount=DEFAULT_PARTITION_COUNT)
    return dataclasses.replace(config, sharing=Sharing(sharing.strategy, tsc, spc, mps))


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
    assert sharing is not None  # _normalize sets it
    sharing_path = join_path(path, "sharing")
    tsc, spc, mps = sharing.timeSlicingConfig, sharing.spacePartitioningConfig, sharing.mpsConfig
    known = sharing.strategy in Strategy.__members__.values()
    if not known:
        errors.append(
            FieldError(
                join_path(sharing_path, "strategy"),
                f"unknown GPU sharing strategy: {sharing.strategy!r} "
                f"(must be one of {', '.join(Strategy)})",
            )
        )
    if tsc is not None and tsc.interval not in Interval.__members__.values():
        errors.append(
            FieldError(
                join_path(join_path(sharing_path, "timeSlicingConfig"), "interval"),
                f"unknown time-slice interval: {tsc.interval!r} "
                f"(must be one of {', '.join(Interval)})",
            )
        )
    count = spc.partitionCount if spc is not None else None
    if count is not None and not 1 <= count <= MAX_PARTITION_COUNT:
        bound = "must be >= 1" if count < 1 else f"must be <= {MAX_PARTITION_COUNT}"
        errors.append(
            FieldError(
                join_path(join_path(sharing_path, "spacePartitioningConfig"), "partitionCount"),
                f"{bound}, got {int_text(count)}",
            )
        )
    if mps is not None:
        errors.extend(_mps_errors(mps, join_path(sharing_path, "mpsConfig")))
    subs = {
        Strategy.TIME_SLICING: ("timeSlicingConfig", tsc),
        Strategy.SPACE_PARTITIONING: ("spacePartitioningConfig", spc),
        Strategy.MPS: ("mpsConfig", mps),
    }
    given = [name for name, sub in subs.values() if sub is not None]
    if len(given) > 1:
        errors.append(FieldError(sharing_path, f"{' and '.join(given)} are mutually exclusive"))
    elif known and given and subs[Strategy(sharing.strategy)][0] != given[0]:
        errors.append(
            FieldError(
                join_path(sharing_path, given[0]), f"not allowed with strategy {sharing.strategy}"
            )
        )
    return errors


def _limit_error(text: str) -> str | None:
    try:
        memory_limit_bytes(text)
    except ValueError as err:
        return str(err)
    return None


def _mps_errors(mps: MpsConfig, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    percentage = mps.defaultActiveThreadPercentage
    if percentage is not None and not 1 <= percentage <= MAX_ACTIVE_THREAD_PERCENTAGE:
        errors.append(
            FieldError(
                join_path(path, "defaultActiveThreadPercentage"),
                f"must be between 1 and {MAX_ACTIVE_THREAD_PERCENTAGE}, got {int_text(percentage)}",
            )
        )
    limit = mps.defaultPinnedDeviceMemoryLimit
    if limit is not None and (problem := _limit_error(limit)) is not None:
        errors.append(FieldError(join_path(path, "defaultPinnedDeviceMemoryLimit"), problem))
    per_device = join_path(path, "defaultPerDevicePinnedMemoryLimit")
    for key, limit in (mps.defaultPerDevicePinnedMemoryLimit or {}).items():
        if (problem := device_key_error(key) or _limit_error(limit)) is not None:
            errors.append(FieldError(join_key(per_device, key), problem))
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
    errors = find_raw_problems(parameters, path, _MAP_FIELDS)
    try:
        model = _GpuConfigModel.model_validate(parameters)
    except ValidationError as err:
        errors.extend(_pydantic_errors(err, path))
        return None, list(dict.fromkeys(errors))  # both walks report a non-string key
    except RecursionError:
        return None, [*errors, FieldError(path, "too deeply nested")]
    if errors:
        return None, errors
    config = _normalize(_as_config(model))
    errors = _static_errors(config, path)
    return (None, errors) if errors else (config, [])


def decode_gpu_config(parameters: object, path: str = "") -> GpuConfig:
    """Decode, default and statically validate one GpuConfig; raise `ConfigError`
    (permanent invalid-config) naming every bad field. See `gpu_config_errors`."""
    config, errors = gpu_config_errors(parameters, path)
    if config is None:
        raise ConfigError(errors)
    return config
