"""The values of an MPS config (docs/mps.md): the bounds, the memory limit as bytes
and as the text `nvidia-cuda-mps-control` and its clients take, and the device keys
of `defaultPerDevicePinnedMemoryLimit`."""

from __future__ import annotations

import re
from typing import Final

from driver.devices.formatting import parse_quantity

MAX_ACTIVE_THREAD_PERCENTAGE: Final = 100
MIB: Final = 1 << 20
#: MPS takes memory limits in whole megabytes (its `M` suffix is MiB).
MIN_PINNED_MEMORY_LIMIT: Final = MIB
#: Keys of `defaultPerDevicePinnedMemoryLimit`: a CUDA device index (decimal, without
#: leading zeros, so that no two keys name one index) or a GPU UUID.
_DEVICE_INDEX: Final = re.compile(r"0|[1-9][0-9]*")
_GPU_UUID: Final = re.compile(
    r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE
)


def is_device_index(key: str) -> bool:
    """Whether a valid key of `defaultPerDevicePinnedMemoryLimit` is an index (else a
    GPU UUID)."""
    return _DEVICE_INDEX.fullmatch(key) is not None


def device_key_error(key: str) -> str | None:
    """Why `key` of `defaultPerDevicePinnedMemoryLimit` names no device (one line);
    None for a device index or a GPU UUID."""
    if _DEVICE_INDEX.fullmatch(key) or _GPU_UUID.fullmatch(key):
        return None
    return "not a device index (0, 1, ...) or a GPU UUID (GPU-<uuid>)"


def memory_limit_bytes(text: str) -> int:
    """A pinned device-memory limit ("8Gi", "512Mi") as bytes, a whole number of MiB;
    ValueError with a one-line reason otherwise."""
    try:
        value = parse_quantity(text)
    except ValueError:
        raise ValueError(f"not a quantity: {text!r} (e.g. 8Gi, 512Mi)") from None
    if value < MIN_PINNED_MEMORY_LIMIT:
        raise ValueError(f"must be at least 1Mi, got {text!r}")
    if value % MIB:
        raise ValueError(f"must be a whole number of Mi (MPS sets limits in MiB), got {text!r}")
    return int(value)


def mps_memory_text(limit_bytes: int) -> str:
    """The limit as `nvidia-cuda-mps-control` and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT read
    it: whole MiB with MPS's `M` suffix."""
    return f"{limit_bytes // MIB}M"
