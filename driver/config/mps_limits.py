"""The values of an MPS config (docs/mps.md): the bounds and the memory limit as bytes
and as the text `nvidia-cuda-mps-control` and its clients take."""

from __future__ import annotations

from typing import Final

from driver.devices.documents import parse_quantity

MAX_ACTIVE_THREAD_PERCENTAGE: Final = 100
MIB: Final = 1 << 20
#: MPS takes memory limits in whole megabytes (its `M` suffix is MiB).
MIN_PINNED_MEMORY_LIMIT: Final = MIB


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
