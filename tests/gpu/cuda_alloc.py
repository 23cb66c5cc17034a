"""A CUDA client for the MPS test (tests/gpu/test_mps.py), through libcuda's driver
API with ctypes: `python -m tests.gpu.cuda_alloc MIB [--hold]` creates a context on
device 0 and allocates MIB MiB of device memory. It prints `allocated` (exit 0) or
`failed <CUresult>` (exit 3); with --hold it keeps the allocation until stdin closes.
libcuda.so.1 is loaded from $NVIDIA_DRIVER_ROOT's library directories, else the
loader's path."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from driver.nvml.library import LIBRARY_DIRS


def _libcuda() -> ctypes.CDLL:
    root = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
    for directory in LIBRARY_DIRS:
        candidate = root / directory / "libcuda.so.1"
        if candidate.exists():
            return ctypes.CDLL(str(candidate))
    return ctypes.CDLL("libcuda.so.1")


def _check(what: str, result: int) -> None:
    if result != 0:
        print(f"{what} failed {result}", flush=True)
        sys.exit(4)


def main(argv: list[str]) -> int:
    mib, hold = int(argv[0]), "--hold" in argv[1:]
    cuda = _libcuda()
    device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    _check("cuInit", cuda.cuInit(0))
    _check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
    _check("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device))
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _check("cuMemGetInfo", cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
    print(f"memory free={free.value >> 20} total={total.value >> 20}", flush=True)
    result = cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(mib << 20))
    if result != 0:
        print(f"failed {result}", flush=True)
        return 3
    print("allocated", flush=True)
    if hold:
        sys.stdin.read()
    cuda.cuMemFree_v2(pointer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
