"""`gpu-dra validate --explain CLAIM.yaml --slices SLICES.yaml|-`: why the scheduler
says "cannot allocate all claims".

For each request (and `firstAvailable` sub-request) of each claim in the files, every
published device of --driver-name is run through the request's DeviceClass selectors
and then its own (`cel_device`, real CEL semantics), in order; the first selector
that is false or fails names why the device is excluded. Each evaluation runs under
DRA's CEL cost budget (driver/cli/validate/explain_selectors.py): a selector that passes it is
stopped, named in a line of its own, and excludes the devices that reach it as an
error would. A device that passes them
all is checked against the request's `capacity.requests` (and, on a device with
`allowMultipleAllocations`, its `requestPolicy`), then against the allocations of the
ResourceClaims given with the slices (driver/cli/validate/allocations.py: whole devices, shares
of capacity, counters; the claim's own allocation is left out). Without ResourceClaims
the output says that allocations were not counted. The DeviceClass comes from the
files (a DeviceClass document) or, for the chart's classes, from the chart's
selectors; another class not in the files is reported and its selectors skipped.

Each request gets a line saying how many devices are left and how many it needs
(`count`, or all for `allocationMode: All`), then a summary (driver/cli/
explain_summary.py): per selector how many devices it excluded and the values of the
attributes it reads on them, the capacity requests' and the allocations' exclusions
with a few examples. `--devices` adds one line per device. Requests are explained one
by one: the devices one request of a claim would take are not taken from the next.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TextIO

from driver.cli.validate.allocations import Allocations, ClaimRef, Taken
from driver.cli.validate.capacity import PolicyViolation, request_consumption
from driver.cli.validate.cel_device import device_activation
from driver.cli.validate.claim_requests import DeviceRequest, device_requests
from driver.cli.validate.explain_selectors import SelectorRun
from driver.cli.validate.explain_summary import (
    ALLOCATIONS,
    FIELDS,
    REQUESTED,
    SELECTOR,
    Exclusion,
    RequestSummary,
)
from driver.cli.validate.slice_devices import SliceDevice, shared_counters, slice_devices
from driver.config import LoadError, load_yaml_documents
from driver.devices.formatting import parse_quantity
from driver.observability.logs import escaped

NOT_COUNTED = (
    "allocations not counted: no ResourceClaims given (add them with the slices: "
    "kubectl get resourceslices,resourceclaims -A -o yaml)"
)


def chart_class_selectors(driver: str) -> dict[str, list[str]]:
    """The selectors of the chart's DeviceClasses (deviceclass.yaml) for `driver`."""
    attrs = f"device.attributes['{driver}']"
    return {
        driver: [
            f"device.driver == '{driver}' && !('profile' in {attrs}) && !('partition' in {attrs})"
        ],
        f"mig.{driver}": [f"device.driver == '{driver}' && 'profile' in {attrs}"],
        f"partition.{driver}": [f"device.driver == '{driver}' && 'partition' in {attrs}"],
    }


def class_selectors(documents: Iterable[object], driver: str) -> dict[str, list[str]]:
    """DeviceClass name -> its CEL selector expressions: the chart's, then those of
    the DeviceClass documents among `documents` (which win)."""
    classes = chart_class_selectors(driver)
    for doc in documents:
        if not isinstance(doc, Mapping) or doc.get("kind") != "DeviceClass":
            continue
        metadata, spec = doc.get("metadata"), doc.get("spec")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        if isinstance(name, str):
            selectors = spec.get("selectors") if isinstance(spec, Mapping) else None
            classes[name] = _expressions(selectors)
    return classes


def _expressions(selectors: object) -> list[str]:
    out = []
    for selector in selectors if isinstance(selectors, list) else []:
        cel = selector.get("cel") if isinstance(selector, Mapping) else None
        expression = cel.get("expression") if isinstance(cel, Mapping) else None
        if isinstance(expression, str):
            out.append(expression)
    return out


@dataclass
class Explanation:
    lines: list[str] = field(default_factory=list)
    unsatisfied: int = 0  # requests with fewer devices left than they need


@dataclass(frozen=True)
class Context:
    """What every request is explained against."""

    devices: list[SliceDevice]
    classes: Mapping[str, list[str]]
    driver: str
    allocations: Allocations | None  # None: no ResourceClaims given
    counters: Mapping[tuple[str, str], Mapping[str, Decimal]]
    details: bool  # --devices: one line per request and device
    taken: Taken | None = None  # what all `allocations` take (claims without their own)


def explain_claim(
    doc: Mapping[str, Any], label: str, context: Context, result: Explanation
) -> None:
    taken = context.taken
    if context.allocations is not None and doc.get("kind") == "ResourceClaim":
        allocations, own = context.allocations.without(ClaimRef.of(doc))
        if own:
            result.lines.append(f"{label}: its own allocation ({own} device(s)) is not counted")
            taken = Taken.of(allocations, context.devices, context.counters)
    for request in device_requests(doc):
        _explain_request(request, label, context, taken, result)


def _explain_request(
    request: DeviceRequest,
    label: str,
    context: Context,
    taken: Taken | None,
    result: Explanation,
) -> None:
    name = request.device_class
    selectors: list[tuple[str, str]] = []
    header = f"{label}: request {request.name} (class {name})"
    notes: list[str] = []
    if isinstance(name, str) and name in context.classes:
        selectors += [
            (f"class {name} selector[{i}]", e) for i, e in enumerate(context.classes[name])
        ]
    else:
        notes.append(f"  DeviceClass {name} is not in the files: its selectors are skipped")
    own = _expressions(request.fields.get("selectors"))
    selectors += [(f"{request.path}.selectors[{i}]", e) for i, e in enumerate(own)]
    compiled = [SelectorRun.compile(where, expression) for where, expression in selectors]
    wanted, asked = _capacity(request)
    summary = RequestSummary(
        [(run.where, run.expression) for run in compiled],
        context.driver,
        counted=taken is not None,
    )
    details: list[str] = []
    left = 0
    for device in context.devices:
        exclusion = _excluded(device, compiled, wanted, asked, context.driver, taken)
        summary.add(device, exclusion)
        if exclusion is None:
            left += 1
        if not context.details:
            continue
        if exclusion is None:
            details.append(f"  {device.name} on {device.node}: matches")
        else:
            details.append(f"  {device.name} on {device.node}: excluded by {exclusion.line}")
    need = _needed(request, left)
    verdict = "enough" if left >= need and left > 0 else "CANNOT ALLOCATE"
    if verdict != "enough":
        result.unsatisfied += 1
    result.lines.append(
        f"{header}: {left} of {len(context.devices)} device(s) match, {need} needed: {verdict}"
    )
    result.lines += notes
    result.lines += [line for run in compiled if (line := run.stopped_line(request.name))]
    result.lines += summary.lines(bool(wanted), context.details)
    result.lines += details


def _excluded(
    device: SliceDevice,
    compiled: list[SelectorRun],
    wanted: Mapping[str, Decimal],
    asked: Mapping[str, str],
    driver: str,
    taken: Taken | None,
) -> Exclusion | None:
    try:
        activation = device_activation(device.document, driver)
    except ValueError as err:
        why = f"its published fields: {err}"
        return Exclusion(FIELDS, why, why)
    for index, run in enumerate(compiled):
        verdict = run.verdict(activation, f"{device.name} on {device.node}")
        if verdict is not None:
            kind, why, line = verdict
            return Exclusion(SELECTOR, why, line, index, kind)
    short = _short_capacity(device, wanted, asked)
    consumption = None
    if short is None and device.fields.get("allowMultipleAllocations") is True:
        capacity = device.fields.get("capacity")
        try:
            consumption = request_consumption(
                capacity if isinstance(capacity, Mapping) else {}, wanted, asked
            )
        except PolicyViolation as err:
            short = str(err)
    if short is not None:
        return Exclusion(REQUESTED, short, f"capacity: {short}")
    if taken is None:
        return None
    found = taken.why_taken(device, consumption)
    if found is None:
        return None
    kind, why = found
    return Exclusion(ALLOCATIONS, why, f"allocations: {why}", kind=kind)


def _capacity(request: DeviceRequest) -> tuple[dict[str, Decimal], dict[str, str]]:
    """The request's `capacity.requests`: name -> amount, and name -> as written."""
    capacity = request.fields.get("capacity")
    requested = capacity.get("requests") if isinstance(capacity, Mapping) else None
    wanted: dict[str, Decimal] = {}
    asked: dict[str, str] = {}
    for key, value in requested.items() if isinstance(requested, Mapping) else ():
        try:
            wanted[str(key)] = parse_quantity(value)
        except (ValueError, TypeError):
            continue  # reported by the capacity check
        asked[str(key)] = str(value)
    return wanted, asked


def _short_capacity(
    device: SliceDevice, wanted: Mapping[str, Decimal], asked: Mapping[str, str]
) -> str | None:
    offered = device.fields.get("capacity") or {}
    for key, amount in sorted(wanted.items()):
        entry = offered.get(key) if isinstance(offered, Mapping) else None
        text = entry.get("value") if isinstance(entry, Mapping) else None
        try:
            value = parse_quantity(text)
        except (ValueError, TypeError):
            return f"no {key} capacity"
        if value < amount:
            return f"{key} {text} < {asked.get(key, amount)} requested"
    return None


def _needed(request: DeviceRequest, left: int) -> int:
    if request.fields.get("allocationMode") == "All":
        return max(left, 1)
    count = request.fields.get("count", 1)
    return count if isinstance(count, int) and count > 0 else 1


def _read(name: str, stdin: TextIO) -> list[Any]:
    """The documents of a file (`-`: standard input). OSError, LoadError."""
    if name == "-":
        return load_yaml_documents(stdin.read())
    with open(name, "rb") as handle:
        return load_yaml_documents(handle.read())


def run_explain(args: argparse.Namespace, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    """Exit code 0 when every request has enough matching devices, 1 when one has not
    or an input cannot be read, 2 without --slices."""
    prog = "gpu-dra validate --explain"
    if not args.slices:
        print(f"{prog}: --slices FILE|- is required (kubectl get resourceslices -o yaml)", file=err)
        return 2
    if list(args.files).count("-") + list(args.slices).count("-") > 1:
        print(f"{prog}: standard input (-) can be read once only", file=err)
        return 2
    documents: list[Any] = []
    slices: list[Any] = []
    name = ""
    try:
        for name in args.files:
            documents += _read(name, stdin)
        for name in args.slices:
            slices += _read(name, stdin)
    except OSError as error:
        print(f"{prog}: {name}: cannot read: {error.strerror or error}", file=err)
        return 1
    except LoadError as error:
        print(f"{prog}: {name}: {error}", file=err)
        return 1
    driver = args.driver_name
    devices = slice_devices(slices, driver)
    allocations = Allocations.read(slices, driver)
    counters = shared_counters(slices, driver)
    context = Context(
        devices=devices,
        classes=class_selectors(documents, driver),
        driver=driver,
        allocations=allocations,
        counters=counters,
        details=bool(getattr(args, "devices", False)),
        taken=None if allocations is None else Taken.of(allocations, devices, counters),
    )
    result = Explanation()
    if context.allocations is None:
        result.lines.append(NOT_COUNTED)
    else:
        published = {device.key for device in context.devices}
        result.lines.append(context.allocations.summary(driver, published))
    claims = 0
    for doc in _flattened(documents):
        if isinstance(doc, Mapping) and doc.get("kind") in (
            "ResourceClaim",
            "ResourceClaimTemplate",
        ):
            claims += 1
            meta = doc.get("metadata")
            name = meta.get("name", "?") if isinstance(meta, Mapping) else "?"
            explain_claim(doc, f"{doc['kind']}/{name}", context, result)
    if claims and not context.details:
        result.lines.append("(per device: add --devices)")
    for line in result.lines:
        print(escaped(line), file=out)
    if claims == 0:
        print(f"{prog}: no ResourceClaim or ResourceClaimTemplate in the files", file=err)
        return 1
    if not context.devices:
        print(f"{prog}: the slices publish no device of {driver}", file=err)
        return 1
    if result.unsatisfied:
        print(f"{prog}: {result.unsatisfied} request(s) cannot be allocated", file=err)
        return 1
    counted = "" if context.allocations is not None else " (allocations not counted)"
    print(f"OK: every request of {claims} claim(s) has enough matching devices{counted}", file=out)
    return 0


def _flattened(documents: Iterable[object]) -> Iterable[object]:
    for doc in documents:
        if isinstance(doc, Mapping) and str(doc.get("kind", "")).endswith("List"):
            items = doc.get("items")
            yield from items if isinstance(items, list) else ()
        else:
            yield doc
