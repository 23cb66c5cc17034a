"""Formatting of resource.k8s.io/v1 device documents: quantities, typed attribute
values, counters. Pure functions shared by the device builders."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
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


_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkMGTPE]i?|Ki)?$")
_SUFFIX_VALUE = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    **{suffix: Decimal(1 << shift) for suffix, shift in _BINARY_SUFFIXES},
}


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes quantity ("16Gi", "20", "1.5G", "500m", "1e3") as a Decimal.
    Raises ValueError for anything else."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"not a quantity: {value!r}")
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = match.group(1), match.group(2) or ""
    try:
        base = Decimal(number)
    except InvalidOperation as err:
        raise ValueError(f"not a quantity: {value!r}") from err
    if suffix[:1] in ("e", "E"):
        return base * (Decimal(10) ** int(suffix[1:]))
    if suffix not in _SUFFIX_VALUE:
        raise ValueError(f"not a quantity: {value!r}")
    return base * _SUFFIX_VALUE[suffix]


def quantity_int(value: object) -> int:
    """A quantity rounded up to a whole number (as the API server rounds to units)."""
    return math.ceil(parse_quantity(value))


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
