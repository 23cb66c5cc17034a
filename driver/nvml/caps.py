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

from pathlib import Path
from typing import Final

CAPABILITIES_DIR: Final = "proc/driver/nvidia/capabilities"
CAPS_DEVICE_DIR: Final = "/dev/nvidia-caps"


class CapabilityError(RuntimeError):
    """A capability file is missing or malformed; names the file."""


def _access_file(driver_root: Path, gpu_minor: int, gi_id: int, ci_id: int | None) -> Path:
    base = driver_root / CAPABILITIES_DIR / f"gpu{gpu_minor}" / "mig" / f"gi{gi_id}"
    return (base / f"ci{ci_id}" if ci_id is not None else base) / "access"


def read_device_minor(path: Path) -> int:
    """The `DeviceFileMinor` of one capability `access` file."""
    try:
        text = path.read_text()
    except OSError as err:
        raise CapabilityError(f"cannot read MIG capability {path}: {err}") from err
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "DeviceFileMinor":
            try:
                return int(value.strip())
            except ValueError:
                break
    raise CapabilityError(f"MIG capability {path} has no valid DeviceFileMinor line")


def mig_device_nodes(driver_root: Path, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[str, str]:
    """The GPU-instance and compute-instance capability device nodes (container
    paths), e.g. `("/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22")`."""
    gi_minor = read_device_minor(_access_file(driver_root, gpu_minor, gi_id, None))
    ci_minor = read_device_minor(_access_file(driver_root, gpu_minor, gi_id, ci_id))
    return (f"{CAPS_DEVICE_DIR}/nvidia-cap{gi_minor}", f"{CAPS_DEVICE_DIR}/nvidia-cap{ci_minor}")
