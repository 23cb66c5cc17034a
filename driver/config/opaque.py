"""The opaque entries of a device config list (`spec.devices.config`,
`status.allocation.devices.config` and the like) that are this driver's, and the
GpuConfig their `parameters` decode to. The decoder (pydantic) loads on the first
decode only: the plugin resolves claims without opaque config without it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from driver.config.config_error import FieldError
from driver.config.loader import join_path

if TYPE_CHECKING:
    from driver.config.gpu import GpuConfig


def driver_entries(
    configs: list[Any],
    path: str,
    driver_name: str,
    errors: list[FieldError],
    *,
    not_opaque: str | None = None,
) -> Iterator[tuple[int, str, Mapping[str, Any]]]:
    """(index, path, opaque) of each entry of `configs` (at `path`) whose `opaque.driver`
    is `driver_name`. The entries' problems are appended to `errors` on the way, in list
    order: an entry or its `opaque` that is not an object and, with `not_opaque` (the
    message), an entry without `opaque`; other drivers' entries are skipped."""
    for index, entry in enumerate(configs):
        entry_path = join_path(path, index)
        if not isinstance(entry, Mapping):
            errors.append(FieldError(entry_path, "must be an object"))
            continue
        opaque = entry.get("opaque")
        if opaque is None:
            if not_opaque is not None:
                errors.append(FieldError(entry_path, not_opaque))
            continue
        if not isinstance(opaque, Mapping):
            errors.append(FieldError(join_path(entry_path, "opaque"), "must be an object"))
            continue
        if opaque.get("driver") == driver_name:
            yield index, entry_path, opaque


def entry_config(
    opaque: Mapping[str, Any], entry_path: str
) -> tuple[GpuConfig | None, list[FieldError]]:
    """The GpuConfig of a `driver_entries` entry: its required `parameters` decoded by
    `opaque_parameters_errors`, errors prefixed with `<entry_path>.opaque.parameters`."""
    params_path = join_path(join_path(entry_path, "opaque"), "parameters")
    if "parameters" not in opaque:
        return None, [FieldError(params_path, "required field missing")]
    return opaque_parameters_errors(opaque["parameters"], params_path)


def opaque_parameters_errors(
    parameters: object, path: str
) -> tuple[GpuConfig | None, list[FieldError]]:
    """`gpu_config_errors` for the `opaque.parameters` of an API object (claim, claim
    template, device class, allocation), which the API server only accepts as a JSON
    object. Anything else, JSON or YAML text in a string included, is refused unparsed:
    only a forged review or a manifest the API server would refuse carries it, and
    parsing it would hand its sender the YAML parser."""
    if not isinstance(parameters, dict):
        return None, [FieldError(path, f"must be a JSON object, got {_json_type(parameters)}")]
    from driver.config.decode import gpu_config_errors  # here only: it loads pydantic

    return gpu_config_errors(parameters, path)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__
