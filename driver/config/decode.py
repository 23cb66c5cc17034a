"""Strict decoding of an opaque GpuConfig (`driver.config.gpu` has the wire format):
pydantic models check the JSON types and fields, then defaults and the static rules
apply. Imported on first use (`driver.config` loads it lazily): the plugin's start and
its prepares of claims without opaque config never pay for pydantic.
"""

from __future__ import annotations

import dataclasses
import enum
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

_MODEL_CONFIG = ConfigDict(strict=True, extra="forbid", frozen=True)


class _TimeSlicingModel(BaseModel):
    model_config = _MODEL_CONFIG

    interval: str | None = None


class _SpacePartitioningModel(BaseModel):
    model_config = _MODEL_CONFIG

    partitionCount: int | None = None


class _MpsModel(BaseModel):
    model_config = _MODEL_CONFIG

    defaultActiveThreadPercentage: int | None = None
    defaultPinnedDeviceMemoryLimit: str | None = None
    defaultPerDevicePinnedMemoryLimit: dict[str, str] | None = None


#: Fields whose value is a map keyed by data: error paths write its keys `field[key]`.
_MAP_FIELDS: Final = frozenset({"defaultPerDevicePinnedMemoryLimit"})


class _SharingModel(BaseModel):
    model_config = _MODEL_CONFIG

    strategy: str
    timeSlicingConfig: _TimeSlicingModel | None = None
    spacePartitioningConfig: _SpacePartitioningModel | None = None
    mpsConfig: _MpsModel | None = None


class _GpuConfigModel(BaseModel):
    model_config = _MODEL_CONFIG

    apiVersion: str
    kind: str
    sharing: _SharingModel | None = None


def _as_config(model: _GpuConfigModel) -> GpuConfig:
    sharing = model.sharing
    if sharing is None:
        return GpuConfig(apiVersion=model.apiVersion, kind=model.kind)
    tsc, spc, mps = sharing.timeSlicingConfig, sharing.spacePartitioningConfig, sharing.mpsConfig
    return GpuConfig(
        apiVersion=model.apiVersion,
        kind=model.kind,
        sharing=Sharing(
            strategy=sharing.strategy,
            timeSlicingConfig=None if tsc is None else TimeSlicingConfig(tsc.interval),
            spacePartitioningConfig=(
                None if spc is None else SpacePartitioningConfig(spc.partitionCount)
            ),
            mpsConfig=(
                None
                if mps is None
                else MpsConfig(
                    mps.defaultActiveThreadPercentage,
                    mps.defaultPinnedDeviceMemoryLimit,
                    _per_device(mps.defaultPerDevicePinnedMemoryLimit),
                )
            ),
        ),
    )


def _per_device(limits: dict[str, str] | None) -> PerDeviceLimits | None:
    return None if limits is None else PerDeviceLimits(limits)


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
    return dataclasses.replace(
        config,
        sharing=Sharing(
            strategy=sharing.strategy,
            timeSlicingConfig=tsc,
            spacePartitioningConfig=spc,
            mpsConfig=mps,
        ),
    )


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
            FieldError(
                join_path(spc_path, "partitionCount"), f"must be >= 1, got {int_text(count)}"
            )
        )
    elif count is not None and count > MAX_PARTITION_COUNT:
        errors.append(
            FieldError(
                join_path(spc_path, "partitionCount"),
                f"must be <= {MAX_PARTITION_COUNT}, got {int_text(count)}",
            )
        )
    errors.extend(_mps_errors(sharing.mpsConfig, join_path(sharing_path, "mpsConfig")))
    given = [
        name
        for name, sub in (
            ("timeSlicingConfig", tsc),
            ("spacePartitioningConfig", spc),
            ("mpsConfig", sharing.mpsConfig),
        )
        if sub is not None
    ]
    own = {
        Strategy.TIME_SLICING: "timeSlicingConfig",
        Strategy.SPACE_PARTITIONING: "spacePartitioningConfig",
        Strategy.MPS: "mpsConfig",
    }
    if len(given) > 1:
        errors.append(FieldError(sharing_path, f"{' and '.join(given)} are mutually exclusive"))
    elif known and given and own[Strategy(sharing.strategy)] != given[0]:
        errors.append(
            FieldError(
                join_path(sharing_path, given[0]), f"not allowed with strategy {sharing.strategy}"
            )
        )
    return errors


def _mps_errors(mps: MpsConfig | None, path: str) -> list[FieldError]:
    if mps is None:
        return []
    errors: list[FieldError] = []
    percentage = mps.defaultActiveThreadPercentage
    if percentage is not None and not 1 <= percentage <= MAX_ACTIVE_THREAD_PERCENTAGE:
        errors.append(
            FieldError(
                join_path(path, "defaultActiveThreadPercentage"),
                f"must be between 1 and {MAX_ACTIVE_THREAD_PERCENTAGE}, got {int_text(percentage)}",
            )
        )
    if mps.defaultPinnedDeviceMemoryLimit is not None:
        field = join_path(path, "defaultPinnedDeviceMemoryLimit")
        try:
            memory_limit_bytes(mps.defaultPinnedDeviceMemoryLimit)
        except ValueError as err:
            errors.append(FieldError(field, str(err)))
    for key, limit in (mps.defaultPerDevicePinnedMemoryLimit or {}).items():
        field = join_key(join_path(path, "defaultPerDevicePinnedMemoryLimit"), key)
        problem = device_key_error(key)
        if problem is None:
            try:
                memory_limit_bytes(limit)
            except ValueError as err:
                problem = str(err)
        if problem is not None:
            errors.append(FieldError(field, problem))
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
        raw = _as_config(_GpuConfigModel.model_validate(parameters))
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
