"""The summary `gpu-dra validate --explain` prints per request (driver/cli/validate/explain.py):
per selector, how many of the devices it was evaluated on it excluded, and the values
the excluded devices have of the attributes and capacities it reads; then how many the
capacity requests and (when ResourceClaims were given) the allocations excluded, with a
few examples. One line per device comes with `--devices` instead of the examples."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from driver.cli.validate.allocations import CAPACITY, COUNTERS, WHOLE
from driver.cli.validate.slice_devices import SliceDevice

#: Stages a device goes through, in order; the first that excludes it is named.
FIELDS, SELECTOR, REQUESTED, ALLOCATIONS = "fields", "selector", "capacity", "allocations"
MAX_VALUES = 6  # distinct values shown per attribute
MAX_REASONS = 4  # distinct reasons shown per capacity or error line
MAX_EXAMPLES = 3  # devices shown per allocations line
ABSENT = "\0absent"  # the value of an attribute a device does not have

_STRING = r"""(?:'([^'\\]*)'|"([^"\\]*)")"""
_DOMAIN = rf"device\.(attributes|capacity)\s*\[\s*{_STRING}\s*\]"
# device.attributes["d"].name, device.attributes["d"]["name"] (not a method: .exists(...))
_ACCESS = re.compile(rf"{_DOMAIN}\s*(?:\.\s*([A-Za-z_]\w*)\b(?!\s*\()|\[\s*{_STRING}\s*\])")
# 'name' in device.attributes["d"]
_HAS = re.compile(rf"{_STRING}\s+in\s+{_DOMAIN}")


def names_read(expression: str, driver: str) -> list[tuple[str, str]]:
    """(`attributes` or `capacity`, the name as the slice publishes it: `profile` in the
    driver's domain, `resource.kubernetes.io/pciBusID` in another) for each attribute and
    capacity the CEL expression reads, in order, once each."""
    found: list[tuple[int, str, str]] = []
    for match in _ACCESS.finditer(expression):
        domain = match.group(2) or match.group(3) or ""
        name = match.group(4) or match.group(5) or match.group(6) or ""
        found.append((match.start(), match.group(1), _qualified(domain, name, driver)))
    for match in _HAS.finditer(expression):
        domain, name = match.group(4) or match.group(5) or "", match.group(1) or match.group(2)
        found.append((match.start(), match.group(3), _qualified(domain, name, driver)))
    ordered: list[tuple[str, str]] = []
    for _, kind, name in sorted(found):
        if (kind, name) not in ordered:
            ordered.append((kind, name))
    return ordered


def _qualified(domain: str, name: str, driver: str) -> str:
    return name if domain == driver else f"{domain}/{name}"


def published_value(device: SliceDevice, kind: str, name: str) -> str | None:
    """The device's value of an attribute (`{string: ...}` -> the string) or capacity,
    as text; None where it has none."""
    entries = device.fields.get(kind)
    entry = entries.get(name) if isinstance(entries, Mapping) else None
    if not isinstance(entry, Mapping):
        return None
    if kind == "capacity":
        return str(entry.get("value"))
    for value in entry.values():
        return str(value).lower() if isinstance(value, bool) else str(value)
    return None


@dataclass(frozen=True)
class Exclusion:
    """Why one device does not serve a request: the stage, the selector's index (for
    SELECTOR), the kind (a selector's `false` or `error`, an allocation's CAPACITY, WHOLE
    or COUNTERS), the reason, and the line `--devices` prints after `excluded by`."""

    stage: str
    why: str
    line: str
    index: int = -1
    kind: str = ""


@dataclass
class _SelectorCount:
    seen: int = 0
    false: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    values: dict[tuple[str, str], Counter[str]] = field(default_factory=dict)


@dataclass
class RequestSummary:
    """The counts of one request, device by device (`add`), and their lines."""

    selectors: list[tuple[str, str]]  # (where and expression, as printed; expression)
    driver: str
    counted: bool  # were allocations given?
    _counts: list[_SelectorCount] = field(default_factory=list)
    _fields: Counter[str] = field(default_factory=Counter)
    _requested: Counter[str] = field(default_factory=Counter)
    _requested_seen: int = 0
    _allocations_seen: int = 0
    _allocated: Counter[str] = field(default_factory=Counter)
    _examples: list[str] = field(default_factory=list)
    _reads: list[list[tuple[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._counts = [_SelectorCount() for _ in self.selectors]
        self._reads = [names_read(expression, self.driver) for _, expression in self.selectors]

    def add(self, device: SliceDevice, exclusion: Exclusion | None) -> None:
        if exclusion is not None and exclusion.stage == FIELDS:
            self._fields[exclusion.why] += 1
            return
        last = exclusion.index if exclusion is not None and exclusion.stage == SELECTOR else None
        for index, count in enumerate(self._counts):
            if last is not None and index > last:
                break
            count.seen += 1
        if exclusion is not None and exclusion.stage == SELECTOR:
            count = self._counts[exclusion.index]
            if exclusion.kind == "false":
                count.false += 1
            else:
                count.errors[exclusion.why] += 1
            for read in self._reads[exclusion.index]:
                value = published_value(device, *read)
                count.values.setdefault(read, Counter())[ABSENT if value is None else value] += 1
            return
        self._requested_seen += 1
        if exclusion is not None and exclusion.stage == REQUESTED:
            self._requested[exclusion.why] += 1
            return
        self._allocations_seen += 1
        if exclusion is not None and exclusion.stage == ALLOCATIONS:
            self._allocated[exclusion.kind] += 1
            if len(self._examples) < MAX_EXAMPLES:
                self._examples.append(f"    {device.name} on {device.node}: {exclusion.why}")

    def lines(self, has_capacity_requests: bool, details: bool) -> list[str]:
        lines: list[str] = []
        if self._fields:
            lines.append(
                f"  published fields: excluded {sum(self._fields.values())} device(s): "
                + _reasons(self._fields)
            )
        for (where, _), count, reads in zip(self.selectors, self._counts, self._reads, strict=True):
            excluded = count.false + sum(count.errors.values())
            parts = [f"{count.false} false"] if count.false else []
            if count.errors:
                parts.append(f"{sum(count.errors.values())} error(s): {_reasons(count.errors)}")
            tail = f": {', '.join(parts)}" if parts else ""
            lines.append(f"  {where}: excluded {excluded} of {count.seen} device(s){tail}")
            for read in reads:
                if read in count.values:
                    lines.append(f"    {read[1]} of the excluded: {_values(count.values[read])}")
        if has_capacity_requests or self._requested:
            excluded = sum(self._requested.values())
            tail = f": {_reasons(self._requested)}" if self._requested else ""
            lines.append(
                f"  capacity requests: excluded {excluded} of {self._requested_seen} device(s)"
                + tail
            )
        if self.counted:
            lines += self._allocation_lines(details)
        return lines

    def _allocation_lines(self, details: bool) -> list[str]:
        excluded = sum(self._allocated.values())
        names = {
            CAPACITY: "without enough capacity left",
            WHOLE: "allocated whole",
            COUNTERS: "without the counters they consume left",
        }
        parts = [f"{self._allocated[k]} {v}" for k, v in names.items() if self._allocated[k]]
        tail = f": {', '.join(parts)}" if parts else ""
        lines = [f"  allocations: excluded {excluded} of {self._allocations_seen} device(s){tail}"]
        if not details:
            lines += self._examples
            if excluded > len(self._examples):
                lines.append(f"    ... {excluded - len(self._examples)} more (--devices)")
        return lines


def _reasons(reasons: Counter[str]) -> str:
    shown = [f"{why} ({n})" for why, n in reasons.most_common(MAX_REASONS)]
    more = len(reasons) - len(shown)
    return "; ".join(shown) + (f"; {more} more reason(s)" if more > 0 else "")


def _values(values: Counter[str]) -> str:
    ordered = sorted(values.items(), key=lambda item: (item[0] == ABSENT, -item[1], item[0]))
    shown = [f"{'absent' if value == ABSENT else value} ({n})" for value, n in ordered[:MAX_VALUES]]
    more = len(ordered) - len(shown)
    return ", ".join(shown) + (f", {more} more value(s)" if more > 0 else "")
