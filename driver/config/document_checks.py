"""Validation of whole Kubernetes documents carrying GpuConfigs (webhook and CLI)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from driver.config.config_error import FieldError
from driver.config.decode import gpu_config_errors
from driver.config.gpu import GROUP, KIND
from driver.config.loader import join_path
from driver.config.opaque import driver_entries, entry_config

RESOURCE_GROUP: Final = "resource.k8s.io"

#: kind -> path of its list of device configs (the same in resource.k8s.io v1, v1beta1, v1beta2)
CONFIG_LIST_PATHS: Final[Mapping[str, tuple[str, ...]]] = {
    "ResourceClaim": ("spec", "devices", "config"),
    "ResourceClaimTemplate": ("spec", "spec", "devices", "config"),
    "DeviceClass": ("spec", "config"),
}


def _group(api_version: object) -> str:
    if not isinstance(api_version, str):
        return ""
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def is_checked_document(doc: object) -> bool:
    """True for documents `validate_claim_document` inspects: GpuConfigs (anything in the
    GpuConfig API group or of kind GpuConfig) and resource.k8s.io ResourceClaims,
    ResourceClaimTemplates and DeviceClasses."""
    if not isinstance(doc, Mapping):
        return True  # reported as malformed
    kind, group = doc.get("kind"), _group(doc.get("apiVersion"))
    if group == GROUP or kind == KIND:
        return True
    return group == RESOURCE_GROUP and isinstance(kind, str) and kind in CONFIG_LIST_PATHS


def _config_list(doc: object, keys: tuple[str, ...]) -> tuple[object, str, list[FieldError]]:
    current, path = doc, ""
    for key in keys:
        if current is None:
            return None, path, []
        if not isinstance(current, Mapping):
            return None, path, [FieldError(path, "must be an object")]
        current = current.get(key)
        path = join_path(path, key)
    return current, path, []


def config_list_of(obj: object, kind: str) -> object:
    """The device config list of a resource.k8s.io object of `kind` (None if absent)."""
    return _config_list(obj, CONFIG_LIST_PATHS[kind])[0]


def validate_object_configs(obj: object, kind: str, driver_name: str) -> list[FieldError]:
    """Check the device configs of `obj`, taken to be a resource.k8s.io `kind`
    (a key of `CONFIG_LIST_PATHS`) whatever its own apiVersion/kind say.

    Entries without `opaque` (other configuration types) and opaque entries for other
    drivers are skipped: the webhook sees every claim in the cluster. Each entry for
    `driver_name` must carry GpuConfig `parameters`, a JSON object (as the API server
    stores it; never text to parse), that decode, default and pass the static rules;
    errors are prefixed with `<path>[i].opaque.parameters`.
    """
    if not isinstance(obj, Mapping):
        return [FieldError("", "must be an object")]
    configs, path, errors = _config_list(obj, CONFIG_LIST_PATHS[kind])
    if errors or configs is None:
        return errors
    if not isinstance(configs, list):
        return [FieldError(path, "must be a list")]
    for _, entry_path, opaque in driver_entries(configs, path, driver_name, errors):
        errors.extend(entry_config(opaque, entry_path)[1])
    return errors


def validate_claim_document(doc: object, driver_name: str) -> list[FieldError]:
    """All GpuConfig problems in one document; [] when it is valid or not ours.

    - GpuConfig documents (bare, as in `gpu-dra validate` files): the whole document
      is decoded; paths are relative to it (`sharing.strategy`).
    - resource.k8s.io ResourceClaim (`spec.devices.config[i]`), ResourceClaimTemplate
      (`spec.spec.devices.config[i]`), DeviceClass (`spec.config[i]`), any version:
      each opaque config for `driver_name`; paths are
      `spec.devices.config[0].opaque.parameters.<field>`.
    - Any other document: [] (see `is_checked_document`).
    """
    if not isinstance(doc, Mapping):
        return [FieldError("", "must be an object")]
    kind, group = doc.get("kind"), _group(doc.get("apiVersion"))
    if group == GROUP or kind == KIND:
        _, problems = gpu_config_errors(dict(doc) if not isinstance(doc, dict) else doc, "")
        return problems
    if group != RESOURCE_GROUP or not isinstance(kind, str) or kind not in CONFIG_LIST_PATHS:
        return []
    return validate_object_configs(doc, kind, driver_name)
