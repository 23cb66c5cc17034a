"""The CUDA client of tests/gpu/test_mps_containers.py, run in a container as a script
that needs nothing but the standard library: `python3 -S cuda_bound.py MARGIN_MIB`.

Through libcuda's driver API (ctypes; the calls tests/gpu/cuda_alloc.py makes on the
host, libcuda.so.1 found through the container's ld cache) it creates a context on
device 0 and reports, one line each, in lock-step with the test, which writes a line
to its stdin at each `ready` and `holding`:

    memory free=<MiB> total=<MiB>   what the context reports (cuMemGetInfo)
    sm context=<n> device=<n>       its SM count (cuCtxGetExecAffinity; `error <CUresult>`
                                    where that fails) and the device's
    ready                           waits: every container has its context
    alloc <MiB> result=<CUresult>   free + MARGIN (freed if it succeeds), then free - MARGIN
    holding                         waits: every container holds its allocation
    done                            the allocation freed; exit 0

A call that must succeed and fails ends it with `error <call> <CUresult>` (exit 4)."""

from __future__ import annotations

import ctypes
import sys
from typing import Protocol, TextIO

READY = "ready"
HOLDING = "holding"
DONE = "done"
CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0


class CudaError(Exception):
    def __init__(self, call: str, result: int) -> None:
        super().__init__(f"{call} {result}")
        self.call, self.result = call, result


class Cuda(Protocol):
    def open_context(self) -> None: ...

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes."""
        ...

    def sm_counts(self) -> tuple[str, int]:
        """The context's SM count (or `error <CUresult>`) and the device's."""
        ...

    def alloc(self, size: int) -> tuple[int, int]:
        """(CUresult, device pointer)."""
        ...

    def free(self, pointer: int) -> None: ...


class _ExecAffinity(ctypes.Structure):
    # CUexecAffinityParam: the type, then a union whose only member is the SM count.
    _fields_ = (("type", ctypes.c_int), ("sm_count", ctypes.c_uint))


class DriverApi:
    """`Cuda` through libcuda.so.1."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._cuda = library
        self._device = ctypes.c_int()

    def _check(self, call: str, result: int) -> None:
        if result != CUDA_SUCCESS:
            raise CudaError(call, result)

    def open_context(self) -> None:
        context = ctypes.c_void_p()
        self._check("cuInit", self._cuda.cuInit(0))
        self._check("cuDeviceGet", self._cuda.cuDeviceGet(ctypes.byref(self._device), 0))
        self._check(
            "cuCtxCreate", self._cuda.cuCtxCreate_v2(ctypes.byref(context), 0, self._device)
        )

    def memory(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(
            "cuMemGetInfo", self._cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        )
        return free.value, total.value

    def sm_counts(self) -> tuple[str, int]:
        device = ctypes.c_int()
        attribute = CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        self._check(
            "cuDeviceGetAttribute",
            self._cuda.cuDeviceGetAttribute(ctypes.byref(device), attribute, self._device),
        )
        affinity = _ExecAffinity()
        result = self._cuda.cuCtxGetExecAffinity(
            ctypes.byref(affinity), CU_EXEC_AFFINITY_TYPE_SM_COUNT
        )
        context = str(affinity.sm_count) if result == CUDA_SUCCESS else f"error {result}"
        return context, device.value

    def alloc(self, size: int) -> tuple[int, int]:
        pointer = ctypes.c_uint64()
        result = self._cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size))
        return result, pointer.value

    def free(self, pointer: int) -> None:
        self._check("cuMemFree", self._cuda.cuMemFree_v2(ctypes.c_uint64(pointer)))


def run(cuda: Cuda, margin_mib: int, commands: TextIO, out: TextIO) -> int:
    """The report above; the exit status."""

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        cuda.open_context()
        free, total = cuda.memory()
        say(f"memory free={free >> 20} total={total >> 20}")
        context_sms, device_sms = cuda.sm_counts()
        say(f"sm context={context_sms} device={device_sms}")
        say(READY)
        commands.readline()
        over, under = (free >> 20) + margin_mib, (free >> 20) - margin_mib
        result, pointer = cuda.alloc(over << 20)
        say(f"alloc {over} result={result}")
        if result == CUDA_SUCCESS:
            cuda.free(pointer)
        result, pointer = cuda.alloc(max(under, 0) << 20)
        say(f"alloc {under} result={result}")
        say(HOLDING)
        commands.readline()
        if result == CUDA_SUCCESS:
            cuda.free(pointer)
        say(DONE)
        return 0
    except CudaError as err:
        say(f"error {err.call} {err.result}")
        return 4


def main(argv: list[str]) -> int:
    try:
        library = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        print(f"error load-libcuda {err}", flush=True)
        return 4
    return run(DriverApi(library), int(argv[0]), sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
