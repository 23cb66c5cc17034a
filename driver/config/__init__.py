"""GpuConfig decode / default / validate, shared by the webhook, the CLI and the plugin.

Public API:
- `decode_gpu_config(parameters, path)` -> `GpuConfig` (defaulted, statically valid)
- `validate_for_device(config, *, device_name, is_partition, max_partitions)`
- `resolve_configs(allocation, driver_name)` -> `{result request: GpuConfig}`
- `validate_claim_document(doc, driver_name)` -> `[FieldError(path, message)]`
- `ConfigError` (permanent invalid-config DriverError with `.errors`)
- `loads_json`, `load_yaml_documents`: loaders that keep duplicate keys detectable
"""

from __future__ import annotations

from driver.config.documents import (
    CONFIG_LIST_PATHS,
    config_list_of,
    is_checked_document,
    validate_claim_document,
    validate_configs,
    validate_object_configs,
)
from driver.config.errors import ConfigError, FieldError
from driver.config.gpu import (
    API_VERSION,
    KIND,
    GpuConfig,
    Interval,
    Sharing,
    SpacePartitioningConfig,
    Strategy,
    TimeSlicingConfig,
    decode_gpu_config,
    default_gpu_config,
    gpu_config_errors,
    validate_for_device,
)
from driver.config.loader import LoadError, load_yaml_documents, loads_json
from driver.config.resolve import request_matches, resolve_configs

__all__ = [
    "API_VERSION",
    "CONFIG_LIST_PATHS",
    "KIND",
    "ConfigError",
    "FieldError",
    "GpuConfig",
    "Interval",
    "LoadError",
    "Sharing",
    "SpacePartitioningConfig",
    "Strategy",
    "TimeSlicingConfig",
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
    "validate_configs",
    "validate_for_device",
    "validate_object_configs",
]
