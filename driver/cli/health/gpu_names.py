"""This node's GPU names (`gpu-<minor>`) by UUID when the published ResourceSlices
cannot be read: from the running plugin's /status, else from NVML on this node, else
from the NVIDIA kernel driver's files (`/proc/driver/nvidia/gpus/*/information`: its
UUID and device minor), which a debug container on the node sees without NVML."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from driver.cli.plugin_endpoint import PluginUnreachable, fetch_status
from driver.devices.gpu_view import gpu_name
from driver.nvml.selection import select_backend

log = logging.getLogger(__name__)

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class GpuNames:
    names: dict[str, str] = field(default_factory=dict)  # GPU UUID -> gpu-<minor>
    source: str | None = None  # where they came from; None: nothing answered
    problem: str | None = None  # why none could be found (source None), one line


def local_gpu_names(status_socket: Path) -> GpuNames:
    try:
        document = fetch_status(status_socket)
    except PluginUnreachable as err:
        plugin_problem = f"the plugin does not answer ({err})"
    else:
        names = {g["uuid"]: g["name"] for g in document.get("gpus") or []}
        return GpuNames(names, "the running plugin")
    try:
        inventory = select_backend(mock=False).discover()
    except Exception as err:  # no NVML here (the mock's pod, a debug container)
        nvml_problem = f"no NVML ({err})"
    else:
        return GpuNames({g.uuid: gpu_name(g.minor) for g in inventory.gpus}, "NVML")
    names = kernel_driver_names(PROC_GPUS)
    if names:
        return GpuNames(names, str(PROC_GPUS))
    log.info("GPU names: %s; %s; none in %s", plugin_problem, nvml_problem, PROC_GPUS)
    return GpuNames(problem=f"{plugin_problem}, {nvml_problem}, no GPU in {PROC_GPUS}")


def kernel_driver_names(directory: Path) -> dict[str, str]:
    """GPU UUID -> `gpu-<minor>` from each GPU's `information` file (`GPU UUID:` and
    `Device Minor:` lines); unreadable files are skipped."""
    names: dict[str, str] = {}
    for path in sorted(directory.glob("*/information")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        fields = {
            key.strip(): value.strip()
            for key, _, value in (line.partition(":") for line in text.splitlines())
        }
        uuid, minor = fields.get("GPU UUID"), fields.get("Device Minor", "")
        if uuid and minor.isdigit():
            names[uuid] = gpu_name(int(minor))
    return names
