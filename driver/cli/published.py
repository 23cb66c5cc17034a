"""What this node's ResourceSlices publish, read from the API server: device names,
their GPUs and placements, and their taints (`gpu-dra health`).

Where the API is: `--kubeconfig`, else $KUBECONFIG, else the in-cluster config (in the
plugin's pod, with its service account, which may list ResourceSlices), else
`~/.kube/config`. Without any of them the slices are not read and the output says so.
Only the newest pool generation counts (older slices are being replaced). A
kubeconfig whose token would go to an `http://` server is refused unless
`--allow-insecure-http` is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.health.failures import Placement
from driver.kube.api import ApiError, KubeApi
from driver.kube.connection import connect
from driver.kube.kubeconfig import InsecureServerError
from driver.kube.publisher import SLICES_PATH

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
PAGE_SIZE = 500


@dataclass(frozen=True)
class SliceDevice:
    """A published device as `HealthStore.device_failure` needs it."""

    name: str
    gpu_uuid: str
    placement: Placement | None
    is_partition: bool
    slice_name: str
    taints: tuple[dict[str, Any], ...]


@dataclass
class PublishedView:
    """This node's published devices, or why they were not read."""

    source: str  # where the API was found, for the output
    devices: list[SliceDevice] = field(default_factory=list)
    problem: str | None = None

    def gpu_names(self) -> dict[str, str]:
        """GPU UUID -> the name of its whole-GPU device."""
        return {d.gpu_uuid: d.name for d in self.devices if not d.is_partition}


def kubeconfig_source(explicit: str | None) -> tuple[str | None, str] | None:
    """(kubeconfig path or None for in-cluster, description), or None when no API
    server is configured."""
    if explicit:
        return explicit, f"kubeconfig {explicit}"
    if os.environ.get("KUBECONFIG"):
        path = os.environ["KUBECONFIG"]
        return path, f"kubeconfig {path} ($KUBECONFIG)"
    if os.environ.get(IN_CLUSTER_ENV):
        return None, "in-cluster service account"
    home = Path.home() / ".kube" / "config"
    if home.is_file():
        return str(home), f"kubeconfig {home}"
    return None


@dataclass(frozen=True)
class SliceListing:
    """The ResourceSlices a field selector matched, or why they were not read."""

    source: str  # where the API was found, for the output
    items: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None  # one line


def list_slices(
    field_selector: str, kubeconfig: str | None, *, allow_insecure_http: bool = False
) -> SliceListing:
    """Every ResourceSlice `field_selector` matches (page by page); never raises for an
    unreachable API (the problem is reported in the listing, on one line)."""
    source = kubeconfig_source(kubeconfig)
    if source is None:
        return SliceListing(
            "none",
            problem="no API server configured (give --kubeconfig, set $KUBECONFIG, or run "
            "in the plugin's pod)",
        )
    path, description = source
    items: list[dict[str, Any]] = []
    try:
        api = KubeApi(connect(path, allow_insecure_http=allow_insecure_http))
        token = None
        while True:
            query = {"fieldSelector": field_selector, "limit": str(PAGE_SIZE)}
            page = api.request("GET", SLICES_PATH, query=query | _cont(token), timeout=10.0)
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return SliceListing(description, items)
    except ApiError as err:
        problem = f"listing ResourceSlices failed: {err}"
    except InsecureServerError as err:
        problem = f"{err}, or pass --allow-insecure-http"
    except Exception as err:  # config errors, connection refused, TLS: all just reported
        problem = f"cannot reach the API server: {err}"
    return SliceListing(description, problem=" ".join(problem.split()))


def _cont(token: str | None) -> dict[str, str]:
    return {"continue": token} if token else {}


def read_published(
    node: str, driver: str, kubeconfig: str | None, *, allow_insecure_http: bool = False
) -> PublishedView:
    """The node's published devices; never raises for an unreachable API (the
    problem is reported in the view)."""
    listing = list_slices(
        f"spec.driver={driver},spec.nodeName={node}",
        kubeconfig,
        allow_insecure_http=allow_insecure_http,
    )
    if listing.problem is not None:
        return PublishedView(listing.source, problem=listing.problem)
    return PublishedView(listing.source, devices=devices_of(listing.items))


def devices_of(slices: list[dict[str, Any]]) -> list[SliceDevice]:
    """The devices of the newest pool generation, in slice and device order."""
    if not slices:
        return []
    newest = max(s["spec"]["pool"]["generation"] for s in slices)
    current = sorted(
        (s for s in slices if s["spec"]["pool"]["generation"] == newest),
        key=lambda s: s["metadata"]["name"],
    )
    return [
        _slice_device(device, s["metadata"]["name"])
        for s in current
        for device in s["spec"].get("devices") or []
    ]


def _attr(device: dict[str, Any], name: str) -> Any:
    value = (device.get("attributes") or {}).get(name) or {}
    for kind in ("string", "int", "bool", "version"):
        if kind in value:
            return value[kind]
    return None


def _slice_device(device: dict[str, Any], slice_name: str) -> SliceDevice:
    parent = _attr(device, "parentUUID")
    start, size = _attr(device, "placementStart"), _attr(device, "placementSize")
    placement = (int(start), int(size)) if start is not None and size is not None else None
    return SliceDevice(
        name=str(device["name"]),
        gpu_uuid=str(parent or _attr(device, "uuid") or ""),
        placement=placement,
        # A partition has a `profile`; the whole GPU of a MIG GPU has a `parentUUID` too.
        is_partition=_attr(device, "profile") is not None,
        slice_name=slice_name,
        taints=tuple(device.get("taints") or ()),
    )
