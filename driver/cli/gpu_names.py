"""This node's GPU names (`gpu-<minor>`) by UUID when the published ResourceSlices
cannot be read: from the running plugin's /status, else from NVML on this node."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from driver.cli.plugin_endpoint import PluginUnreachable, fetch_status
from driver.devices.gpu_view import gpu_name
from driver.nvml.backend import select_backend

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuNames:
    names: dict[str, str] = field(default_factory=dict)  # GPU UUID -> gpu-<minor>
    source: str | None = None  # "plugin", "nvml"; None: neither answered


def local_gpu_names(status_socket: Path) -> GpuNames:
    try:
        document = fetch_status(status_socket)
    except PluginUnreachable as err:
        log.info("GPU names: the plugin did not answer (%s); asking NVML", err)
    else:
        return GpuNames({g["uuid"]: g["name"] for g in document.get("gpus") or []}, "plugin")
    try:
        inventory = select_backend(mock=False).discover()
    except Exception as err:  # no NVML here (the mock's pod, a host without a driver)
        log.info("GPU names: NVML discovery failed: %s", err)
        return GpuNames()
    return GpuNames({g.uuid: gpu_name(g.minor) for g in inventory.gpus}, "nvml")
