"""The device requests and configs of a ResourceClaim or ResourceClaimTemplate document,
as `gpu-dra validate` reads them in every resource.k8s.io version: v1 and v1beta2 keep a
request's device fields under `exactly`, v1beta1 on the request itself. A
`firstAvailable` sub-request is named `<request>/<sub-request>`, as allocation results
and configs name it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from driver.config.loader import join_path


@dataclass(frozen=True)
class DeviceRequest:
    """One request, or one sub-request of a `firstAvailable` request."""

    name: str  # `gpu`, or `gpu/small` for a sub-request
    path: str  # where `fields` are, e.g. `spec.devices.requests[0].exactly`
    fields: Mapping[str, Any]  # deviceClassName, selectors, capacity, ...

    @property
    def device_class(self) -> object:
        return self.fields.get("deviceClassName")


@dataclass(frozen=True)
class ClaimConfig:
    """One entry of the claim's `devices.config`."""

    path: str  # e.g. `spec.devices.config[0]`
    requests: tuple[str, ...]  # the requests it names; () applies it to all
    driver: object  # `opaque.driver`; None for a config that is not opaque
    parameters: object


def _devices(doc: Mapping[str, Any]) -> tuple[Mapping[str, Any], str] | None:
    """The claim spec's `devices` and its field path."""
    if doc.get("kind") == "ResourceClaimTemplate":
        outer = doc.get("spec")
        spec, prefix = (outer.get("spec") if isinstance(outer, Mapping) else None), "spec.spec"
    elif doc.get("kind") == "ResourceClaim":
        spec, prefix = doc.get("spec"), "spec"
    else:
        return None
    devices = spec.get("devices") if isinstance(spec, Mapping) else None
    return (devices, f"{prefix}.devices") if isinstance(devices, Mapping) else None


def device_requests(doc: object) -> list[DeviceRequest]:
    """Every request and sub-request of a claim document, in order ([] for other kinds)."""
    found = _devices(doc) if isinstance(doc, Mapping) else None
    if found is None:
        return []
    devices, prefix = found
    requests = devices.get("requests")
    result: list[DeviceRequest] = []
    for index, request in enumerate(requests if isinstance(requests, list) else []):
        if not isinstance(request, Mapping):
            continue
        name, path = str(request.get("name")), join_path(f"{prefix}.requests", index)
        exactly, subs = request.get("exactly"), request.get("firstAvailable")
        if isinstance(exactly, Mapping):
            result.append(DeviceRequest(name, join_path(path, "exactly"), exactly))
        elif isinstance(subs, list) and subs:
            for sub_index, sub in enumerate(subs):
                if isinstance(sub, Mapping):
                    sub_path = join_path(join_path(path, "firstAvailable"), sub_index)
                    result.append(DeviceRequest(f"{name}/{sub.get('name')}", sub_path, sub))
        elif "deviceClassName" in request:  # resource.k8s.io/v1beta1
            result.append(DeviceRequest(name, path, request))
    return result


def claim_configs(doc: object) -> list[ClaimConfig]:
    """Every well-formed entry of a claim document's `devices.config`, in order."""
    found = _devices(doc) if isinstance(doc, Mapping) else None
    if found is None:
        return []
    devices, prefix = found
    configs = devices.get("config")
    result: list[ClaimConfig] = []
    for index, entry in enumerate(configs if isinstance(configs, list) else []):
        if not isinstance(entry, Mapping):
            continue
        requests = entry.get("requests") or []
        opaque = entry.get("opaque")
        opaque = opaque if isinstance(opaque, Mapping) else {}
        result.append(
            ClaimConfig(
                path=join_path(f"{prefix}.config", index),
                requests=tuple(str(r) for r in requests) if isinstance(requests, list) else (),
                driver=opaque.get("driver"),
                parameters=opaque.get("parameters"),
            )
        )
    return result


def request_names(requests: list[DeviceRequest]) -> list[str]:
    """The names a config may give: each request, and each `<request>/<sub-request>`."""
    names: list[str] = []
    for request in requests:
        for name in (request.name.split("/", 1)[0], request.name):
            if name not in names:
                names.append(name)
    return names
