"""`gpu-dra validate --explain CLAIM.yaml --slices SLICES.yaml|-`: why the scheduler
says "cannot allocate all claims".

For each request (and `firstAvailable` sub-request) of each claim in the files, every
published device of --driver-name is run through the request's DeviceClass selectors
and then its own (`cel_device`, real CEL semantics), in order; the first selector
that is false or fails names why the device is excluded. A device that passes them
all is checked against the request's `capacity.requests`. The request's line then
says how many devices are left and how many it needs (`count`, or all for
`allocationMode: All`). The DeviceClass comes from the files (a DeviceClass document)
or, for the chart's classes, from the chart's selectors; another class not in the
files is reported and its selectors skipped. Devices of one node are not checked
against other claims' allocations: what is already allocated is not in the slices.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, TextIO

from driver.cli.cel_device import CelError, Selector, device_activation
from driver.cli.claim_requests import DeviceRequest, device_requests
from driver.config import LoadError, load_yaml_documents
from driver.devices.documents import parse_quantity
from driver.observability.logs import escaped


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


@dataclass(frozen=True)
class SliceDevice:
    node: str
    name: str
    document: Mapping[str, Any]


def slice_devices(documents: Iterable[object], driver: str) -> list[SliceDevice]:
    """The devices of `driver` in ResourceSlice documents (Lists' items too)."""
    found: list[SliceDevice] = []
    for doc in documents:
        if not isinstance(doc, Mapping):
            continue
        if str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list):
            found += slice_devices(doc["items"], driver)
            continue
        spec = doc.get("spec")
        if doc.get("kind") != "ResourceSlice" or not isinstance(spec, Mapping):
            continue
        if spec.get("driver") != driver:
            continue
        pool = spec.get("pool")
        node = spec.get("nodeName") or (pool.get("name") if isinstance(pool, Mapping) else "")
        for device in spec.get("devices") or []:
            if isinstance(device, Mapping):
                found.append(SliceDevice(str(node or "?"), str(device.get("name")), device))
    return found


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


def explain_claim(
    doc: Mapping[str, Any],
    label: str,
    devices: list[SliceDevice],
    classes: Mapping[str, list[str]],
    driver: str,
    result: Explanation,
) -> None:
    for request in device_requests(doc):
        _explain_request(request, label, devices, classes, driver, result)


def _explain_request(
    request: DeviceRequest,
    label: str,
    devices: list[SliceDevice],
    classes: Mapping[str, list[str]],
    driver: str,
    result: Explanation,
) -> None:
    name = request.device_class
    selectors: list[tuple[str, str]] = []
    header = f"{label}: request {request.name} (class {name})"
    lines: list[str] = []
    if isinstance(name, str) and name in classes:
        selectors += [(f"class {name} selector[{i}]", e) for i, e in enumerate(classes[name])]
    else:
        lines.append(f"  DeviceClass {name} is not in the files: its selectors are skipped")
    own = _expressions(request.fields.get("selectors"))
    selectors += [(f"{request.path}.selectors[{i}]", e) for i, e in enumerate(own)]
    compiled: list[tuple[str, Selector | CelError]] = []
    for where, expression in selectors:
        try:
            compiled.append((f"{where} {expression!r}", Selector(expression)))
        except CelError as err:
            compiled.append((f"{where} {expression!r}", err))
    wanted = _capacity(request)
    left = 0
    for device in devices:
        why = _excluded(device, compiled, wanted, driver)
        if why is None:
            left += 1
            lines.append(f"  {device.name} on {device.node}: matches")
        else:
            lines.append(f"  {device.name} on {device.node}: excluded by {why}")
    need = _needed(request, left)
    verdict = "enough" if left >= need and left > 0 else "CANNOT ALLOCATE"
    if verdict != "enough":
        result.unsatisfied += 1
    result.lines.append(
        f"{header}: {left} of {len(devices)} device(s) match, {need} needed: {verdict}"
    )
    result.lines += lines


def _excluded(
    device: SliceDevice,
    compiled: list[tuple[str, Selector | CelError]],
    wanted: Mapping[str, Decimal],
    driver: str,
) -> str | None:
    try:
        activation = device_activation(device.document, driver)
    except ValueError as err:
        return f"its published fields: {err}"
    for where, selector in compiled:
        if isinstance(selector, CelError):
            return f"{where}: {selector}"
        try:
            if not selector.matches(activation):
                return f"{where} (false)"
        except CelError as err:
            return f"{where}: error: {err}"
    return _short_capacity(device, wanted)


def _capacity(request: DeviceRequest) -> dict[str, Decimal]:
    capacity = request.fields.get("capacity")
    asked = capacity.get("requests") if isinstance(capacity, Mapping) else None
    wanted: dict[str, Decimal] = {}
    for key, value in (asked or {}).items() if isinstance(asked, Mapping) else ():
        try:
            wanted[str(key)] = parse_quantity(value)
        except (ValueError, TypeError):
            continue  # reported by the capacity check
    return wanted


def _short_capacity(device: SliceDevice, wanted: Mapping[str, Decimal]) -> str | None:
    offered = device.document.get("capacity") or {}
    for key, amount in sorted(wanted.items()):
        entry = offered.get(key) if isinstance(offered, Mapping) else None
        text = entry.get("value") if isinstance(entry, Mapping) else None
        try:
            value = parse_quantity(text)
        except (ValueError, TypeError):
            return f"capacity: no {key} capacity"
        if value < amount:
            return f"capacity: {key} {text} < {amount} requested"
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
    try:
        for name in args.files:
            documents += _read(name, stdin)
        for name in args.slices:
            slices += _read(name, stdin)
    except (OSError, LoadError) as error:
        print(f"{prog}: {getattr(error, 'filename', None) or ''}{error}", file=err)
        return 1
    devices = slice_devices(slices, args.driver_name)
    classes = class_selectors(documents, args.driver_name)
    result = Explanation()
    claims = 0
    for doc in _flattened(documents):
        if isinstance(doc, Mapping) and doc.get("kind") in (
            "ResourceClaim",
            "ResourceClaimTemplate",
        ):
            claims += 1
            meta = doc.get("metadata")
            name = meta.get("name", "?") if isinstance(meta, Mapping) else "?"
            label = f"{doc['kind']}/{name}"
            explain_claim(doc, label, devices, classes, args.driver_name, result)
    for line in result.lines:
        print(escaped(line), file=out)
    if claims == 0:
        print(f"{prog}: no ResourceClaim or ResourceClaimTemplate in the files", file=err)
        return 1
    if not devices:
        print(f"{prog}: the slices publish no device of {args.driver_name}", file=err)
        return 1
    if result.unsatisfied:
        print(f"{prog}: {result.unsatisfied} request(s) cannot be allocated", file=err)
        return 1
    print(f"OK: every request of {claims} claim(s) has enough matching devices", file=out)
    return 0


def _flattened(documents: Iterable[object]) -> Iterable[object]:
    for doc in documents:
        if isinstance(doc, Mapping) and str(doc.get("kind", "")).endswith("List"):
            items = doc.get("items")
            yield from items if isinstance(items, list) else ()
        else:
            yield doc
