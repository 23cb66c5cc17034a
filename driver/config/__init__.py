"""GpuConfig decode / default / validate, shared by the webhook, the CLI and the plugin.

Public API:
- `decode_gpu_config(parameters, path)` -> `GpuConfig` (defaulted, statically valid)
- `validate_for_device(config, *, device_name, is_partition, max_partitions)`
- `resolve_configs(allocation, driver_name)` -> `{result request: GpuConfig}`
- `validate_claim_document(doc, driver_name)` -> `[FieldError(path, message)]`
- `ConfigError` (permanent invalid-config DriverError with `.errors`)
- `loads_json`, `load_yaml_documents`: loaders that keep duplicate keys detectable

The decoding names (`driver.config.decode`, `driver.config.document_checks`) and the YAML
loader load on first use: they bring pydantic and PyYAML, which the plugin's start and
its prepares of claims without opaque config do not need (its API client imports
`loads_json` from here).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from driver.config.config_error import ConfigError, FieldError
from driver.config.gpu import (
    API_VERSION,
    KIND,
    GpuConfig,
    Interval,
    Strategy,
    default_gpu_config,
    validate_for_device,
)
from driver.config.loader import LoadError, loads_json
from driver.config.resolve import request_matches, resolve_configs

if TYPE_CHECKING:
    from driver.config.decode import decode_gpu_config, gpu_config_errors
    from driver.config.document_checks import (
        CONFIG_LIST_PATHS,
        config_list_of,
        is_checked_document,
        validate_claim_document,
        validate_object_configs,
    )
    from driver.config.yaml_loader import load_yaml_documents

_LAZY_MODULES = {
    "decode_gpu_config": "driver.config.decode",
    "gpu_config_errors": "driver.config.decode",
    "CONFIG_LIST_PATHS": "driver.config.document_checks",
    "config_list_of": "driver.config.document_checks",
    "is_checked_document": "driver.config.document_checks",
    "validate_claim_document": "driver.config.document_checks",
    "validate_object_configs": "driver.config.document_checks",
    "load_yaml_documents": "driver.config.yaml_loader",
}


def __getattr__(name: str) -> object:
    module = _LAZY_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "API_VERSION",
    "CONFIG_LIST_PATHS",
    "KIND",
    "ConfigError",
    "FieldError",
    "GpuConfig",
    "Interval",
    "LoadError",
    "Strategy",
    "config_list_of",
    "decode_gpu_config",
    "default_gpu_config",
    "gpu_config_errors",
    "is_checked_document",
    "load_yaml_documents",
    "loads_json",
    "request_matches",
    "resolve_configs",
    "validate_claim_document",
    "validate_for_device",
    "validate_object_configs",
]
