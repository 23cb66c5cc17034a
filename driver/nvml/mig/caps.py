"""MIG capability device nodes: which `/dev/nvidia-caps/nvidia-cap<minor>` files a
container needs to open a MIG device.

The NVIDIA kernel driver exposes one capability per GPU instance and per compute
instance; its device-file minor is in
`/proc/driver/nvidia/capabilities/gpu<gpu minor>/mig/gi<gi>/access` and
`.../gi<gi>/ci<ci>/access`, as lines `DeviceFileMinor: <n>`,
`DeviceFileMode: <mode>`, `DeviceFileModify: <0|1>`. A process may use a MIG device
only if it can open both capability device nodes (plus the parent's
`/dev/nvidia<minor>` and the control nodes), which is why a CDI spec for a MIG
device lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

CAPABILITIES_DIR: Final = "proc/driver/nvidia/capabilities"
CAPS_DEVICE_DIR: Final = "/dev/nvidia-caps"
DEFAULT_MODE: Final = 0o444  # the driver's default for MIG capabilities


class CapabilityError(RuntimeError):
    """A capability file is missing or malformed; names the file."""


def _access_file(driver_root: Path, gpu_minor: int, gi_id: int, ci_id: int | None) -> Path:
    base = driver_root / CAPABILITIES_DIR / f"gpu{gpu_minor}" / "mig" / f"gi{gi_id}"
    return (base / f"ci{ci_id}" if ci_id is not None else base) / "access"


@dataclass(frozen=True)
class CapabilityNode:
    """A capability's device file: `/dev/nvidia-caps/nvidia-cap<minor>`, its mode."""

    minor: int
    mode: int


def read_capability(path: Path) -> CapabilityNode:
    """The `DeviceFileMinor` and `DeviceFileMode` (decimal) of one `access` file."""
    try:
        text = path.read_text()
    except OSError as err:
        raise CapabilityError(f"cannot read MIG capability {path}: {err}") from err
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = (part.strip() for part in line.partition(":"))
        if sep and key in ("DeviceFileMinor", "DeviceFileMode"):
            try:
                fields[key] = int(value)
            except ValueError:
                raise CapabilityError(f"MIG capability {path}: {key} is not a number") from None
    if "DeviceFileMinor" not in fields:
        raise CapabilityError(f"MIG capability {path} has no valid DeviceFileMinor line")
    return CapabilityNode(fields["DeviceFileMinor"], fields.get("DeviceFileMode", DEFAULT_MODE))


def mig_capabilities(
    driver_root: Path, gpu_minor: int, gi_id: int, ci_id: int
) -> tuple[CapabilityNode, CapabilityNode]:
    """The GPU-instance and compute-instance capabilities of one MIG device."""
    return (
        read_capability(_access_file(driver_root, gpu_minor, gi_id, None)),
        read_capability(_access_file(driver_root, gpu_minor, gi_id, ci_id)),
    )
