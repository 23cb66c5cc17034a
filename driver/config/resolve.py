"""Effective config per allocation result (plugin side, at prepare).

The scheduler copies configs into `status.allocation.devices.config[]`, class
configs (`source: FromClass`) and claim configs (`source: FromClaim`), each with
`requests` (empty = all) and, for opaque ones, `opaque: {driver, parameters}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from driver.config.config_error import ConfigError, FieldError
from driver.config.gpu import GpuConfig, default_gpu_config
from driver.config.loader import join_path
from driver.config.opaque import driver_entries, entry_config

_SOURCE_ORDER: Final = {"FromClass": 0, "FromClaim": 1}

DEFAULT_CONFIG_PATH: Final = "status.allocation.devices.config"


def request_matches(config_request: str, result_request: str) -> bool:
    """A config naming request `r` applies to results of `r` and of its sub-requests `r/<sub>`;
    a config naming `r/<sub>` applies only to that sub-request."""
    return result_request == config_request or result_request.startswith(config_request + "/")


def resolve_configs(
    allocation: Mapping[str, Any],
    driver_name: str,
    path_prefix: str = DEFAULT_CONFIG_PATH,
) -> dict[str, GpuConfig]:
    """The effective GpuConfig of every allocation result of `driver_name`.

    `allocation` is a ResourceClaim's `status.allocation` as a JSON dict (for
    duplicate-key detection read the claim with `driver.config.loader.loads_json`).
    Returns `{result["request"]: GpuConfig}` with an entry for every result of the
    driver (the key may be a sub-request `"r/sub"`); all results of one request
    share the same config.

    Rules (docs/architecture.md "Config precedence"): class configs, then claim
    configs, each in list order; the last matching one wins as a whole (no field
    merging); empty `requests` matches every result; no match gets
    `default_gpu_config()`.

    Raises `ConfigError` (permanent invalid-config) listing every problem: a
    non-opaque entry, an unknown `source`, or any of this driver's configs that does
    not decode/validate (checked even if it matches no result), with paths like
    `status.allocation.devices.config[1].opaque.parameters.sharing.strategy`.
    """
    errors: list[FieldError] = []
    devices_path = path_prefix.rsplit(".", 1)[0] if "." in path_prefix else ""
    if not isinstance(allocation, Mapping):
        allocation_path = devices_path.rsplit(".", 1)[0] if "." in devices_path else ""
        raise ConfigError([(allocation_path, "must be an object")])
    devices = allocation.get("devices")
    devices = {} if devices is None else devices
    if not isinstance(devices, Mapping):
        raise ConfigError([(devices_path, "must be an object")])
    results = devices.get("results") or []
    raw_configs = devices.get("config") or []
    if not isinstance(results, list):
        raise ConfigError([(join_path(devices_path, "results"), "must be a list")])
    if not isinstance(raw_configs, list):
        raise ConfigError([(path_prefix, "must be a list")])

    # (source order, requests or None for "all", config), in list order
    candidates: list[tuple[int, list[str] | None, GpuConfig]] = []
    for index, entry_path, opaque in driver_entries(
        raw_configs,
        path_prefix,
        driver_name,
        errors,
        not_opaque="only opaque parameters are supported by this driver",
    ):
        entry = raw_configs[index]
        source = entry.get("source")
        if source not in _SOURCE_ORDER:
            errors.append(
                FieldError(join_path(entry_path, "source"), f"invalid config source: {source!r}")
            )
            continue
        requests = entry.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            errors.append(
                FieldError(join_path(entry_path, "requests"), "must be a list of strings")
            )
            continue
        config, problems = entry_config(opaque, entry_path)
        if config is None:
            errors.extend(problems)
            continue
        candidates.append((_SOURCE_ORDER[source], list(requests) or None, config))

    wanted: list[str] = []
    for index, result in enumerate(results):
        if not isinstance(result, Mapping):
            errors.append(
                FieldError(join_path(devices_path, f"results[{index}]"), "must be an object")
            )
            continue
        if result.get("driver") != driver_name:
            continue
        request = result.get("request")
        if not isinstance(request, str):
            errors.append(
                FieldError(
                    join_path(join_path(devices_path, f"results[{index}]"), "request"),
                    "must be a string",
                )
            )
            continue
        wanted.append(request)
    if errors:
        raise ConfigError(errors)

    candidates.sort(key=lambda c: c[0])  # stable: class configs, then claim configs
    resolved: dict[str, GpuConfig] = {}
    for request in wanted:
        resolved[request] = default_gpu_config()
        for _, requests, config in candidates:
            if requests is None or any(request_matches(r, request) for r in requests):
                resolved[request] = config  # the last match wins
    return resolved
