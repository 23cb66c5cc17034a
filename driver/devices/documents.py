"""Formatting of resource.k8s.io/v1 device documents: quantities, typed attribute
values, counters. Pure functions shared by the device builders."""

from __future__ import annotations

import re
from typing import Any

_BINARY_SUFFIXES = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))

# Capacity name (C identifier) -> counter name (DNS label) -> PartitionProfile field.
MIG_DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    ("memory", "memory", "memory_bytes"),
    ("multiprocessors", "multiprocessors", "multiprocessors"),
    ("copyEngines", "copy-engines", "copy_engines"),
    ("decoders", "decoders", "decoders"),
    ("encoders", "encoders", "encoders"),
    ("jpegEngines", "jpeg-engines", "jpeg_engines"),
    ("ofaEngines", "ofa-engines", "ofa_engines"),
)


def binary_quantity(value: int) -> str:
    """Canonical Kubernetes BinarySI quantity: 85899345920 -> "80Gi", 1536 -> "1536"."""
    if value < 0:
        raise ValueError(f"negative quantity {value}")
    for suffix, shift in _BINARY_SUFFIXES:
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def decimal_quantity(value: int) -> str:
    return str(value)


def normalize_version(version: str | None) -> str | None:
    """A strict semver string: "580.95.05" -> "580.95.5", "9.0" -> "9.0.0"; None if unusable."""
    if version is None:
        return None
    match = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        return None
    parts = [int(p) if p is not None else 0 for p in match.groups()]
    return f"{parts[0]}.{parts[1]}.{parts[2]}"


def profile_label(profile: str) -> str:
    """A MIG profile name as a DNS-label fragment: "1g.10gb+me" -> "1g10gb-me"."""
    label = profile.lower().replace(".", "")
    label = re.sub(r"[^a-z0-9]+", "-", label).strip("-")
    return label or "profile"


def string_attr(v: str) -> dict[str, Any]:
    return {"string": v}


def int_attr(v: int) -> dict[str, Any]:
    return {"int": v}


def bool_attr(v: bool) -> dict[str, Any]:
    return {"bool": v}


def version_attr(v: str) -> dict[str, Any]:
    return {"version": v}


def quantity(v: str) -> dict[str, Any]:
    return {"value": v}


def device_doc(name: str, attributes: dict[str, Any], capacity: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name, "attributes": attributes}
    if capacity:
        doc["capacity"] = capacity
    return doc


def counter_quantity(counter: str, value: int) -> str:
    return binary_quantity(value) if counter == "memory" else decimal_quantity(value)


def counters(values: dict[str, int], *, skip_zero: bool) -> dict[str, Any]:
    return {
        name: quantity(counter_quantity(name, v))
        for name, v in values.items()
        if v or not skip_zero
    }
