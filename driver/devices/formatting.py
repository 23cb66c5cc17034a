"""Formatting of resource.k8s.io/v1 device documents: quantities and counters. Pure
functions shared by the device builders."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal
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


# A number Decimal reads, then an exponent or a suffix of `_SUFFIX_VALUE`.
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
)
_SUFFIX_VALUE = {
    "": Decimal(1),
    **{suffix: Decimal(10) ** (3 * i) for i, suffix in enumerate("kMGTPE", 1)},
    **{suffix: Decimal(10) ** (-3 * i) for i, suffix in enumerate("mun", 1)},
    **{suffix: Decimal(1 << shift) for suffix, shift in _BINARY_SUFFIXES},
}


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes quantity ("16Gi", "20", "1.5G", "500m", "1e3") as a Decimal.
    Raises ValueError for anything else."""
    is_text = isinstance(value, (str, int)) and not isinstance(value, bool)
    match = _QUANTITY.match(str(value).strip()) if is_text else None
    if match is None:
        raise ValueError(f"not a quantity: {value!r}")
    base, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix in _SUFFIX_VALUE:  # before the exponent: `E` and `Ei` are exa, not e
        return base * _SUFFIX_VALUE[suffix]
    return base * (Decimal(10) ** int(suffix[1:]))


def quantity_int(value: object) -> int:
    """A quantity rounded up to a whole number (as the API server rounds to units)."""
    return math.ceil(parse_quantity(value))


def decimal_quantity(value: int) -> str:
    return str(value)


def normalize_version(version: str | None) -> str | None:
    """A strict semver string: "580.95.05" -> "580.95.5", "9.0" -> "9.0.0"; None if unusable."""
    match = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version or "")
    if match is None:
        return None
    return ".".join(str(int(p or 0)) for p in match.groups())


def profile_label(profile: str) -> str:
    """A MIG profile name as a DNS-label fragment: "1g.10gb+me" -> "1g10gb-me"."""
    label = profile.lower().replace(".", "")
    label = re.sub(r"[^a-z0-9]+", "-", label).strip("-")
    return label or "profile"


def taint_text(taint: Mapping[str, Any]) -> str:
    """A device taint as kubectl shows it: `<key>[=<value>][:<effect>]`."""
    value = f"={taint['value']}" if taint.get("value") else ""
    effect = f":{taint['effect']}" if taint.get("effect") else ""
    return f"{taint.get('key')}{value}{effect}"


def counter_quantity(counter: str, value: int) -> str:
    return binary_quantity(value) if counter == "memory" else decimal_quantity(value)


def counters(values: dict[str, int], *, skip_zero: bool) -> dict[str, Any]:
    return {
        name: {"value": counter_quantity(name, v)}
        for name, v in values.items()
        if v or not skip_zero
    }
