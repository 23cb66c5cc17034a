"""A busy CUDA client for the MPS throughput test (tests/gpu/test_mps_throughput.py), a
script that needs the standard library only: `python3 -S cuda_busy.py SECONDS`.

Through libcuda's driver API (ctypes; libcuda.so.1 from the loader's path) it creates
a context on device 0, loads a kernel from PTX (the driver compiles it for the GPU: no
CUDA toolkit needed) that runs a chain of dependent multiply-adds in every thread, and
reports, one line each, in lock-step with the test, which writes a line to its stdin
at `ready`:

    sm context=<n> device=<n>     its SM count (cuCtxGetExecAffinity) and the device's
    ready                         waits: every client has its context and kernel
    busy launches=<n> seconds=<s> launches of the same grid finished in SECONDS
    done                          exit 0

A failed call ends it with `error <call> <CUresult>` (exit 4)."""

from __future__ import annotations

import ctypes
import sys
import time

CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_EXEC_AFFINITY_TYPE_SM_COUNT = 0
THREADS_PER_BLOCK = 256
BLOCKS_PER_SM = 8  # 2048 threads per SM: a full wave on Volta through Hopper
ITERATIONS = 200_000  # per thread: a launch of a few milliseconds on a whole H100

# out[i] = a chain of ITERATIONS dependent f = f * 1 + 1 from f = i (global index).
PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry busy(.param .u64 out, .param .u32 iterations)
{
    .reg .pred %p<2>;
    .reg .b32 %r<7>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [iterations];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    cvt.rn.f32.u32 %f1, %r5;
    mov.f32 %f2, 0f3F800000;
LOOP:
    fma.rn.f32 %f1, %f1, %f2, %f2;
    sub.u32 %r1, %r1, 1;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra LOOP;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.u64 %rd4, %rd2, %rd3;
    st.global.f32 [%rd4], %f1;
    ret;
}
"""


class _ExecAffinity(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("sm_count", ctypes.c_uint))


class CudaError(Exception):
    def __init__(self, call: str, result: int) -> None:
        super().__init__(f"{call} {result}")
        self.call, self.result = call, result


def _check(call: str, result: int) -> None:
    if result != CUDA_SUCCESS:
        raise CudaError(call, result)


def run(cuda: ctypes.CDLL, seconds: float) -> None:
    def say(line: str) -> None:
        print(line, flush=True)

    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check("cuInit", cuda.cuInit(0))
    _check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
    _check("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device))
    sms = ctypes.c_int()
    _check(
        "cuDeviceGetAttribute",
        cuda.cuDeviceGetAttribute(
            ctypes.byref(sms), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device
        ),
    )
    affinity = _ExecAffinity()
    result = cuda.cuCtxGetExecAffinity(ctypes.byref(affinity), CU_EXEC_AFFINITY_TYPE_SM_COUNT)
    context_sms = str(affinity.sm_count) if result == CUDA_SUCCESS else f"error {result}"
    say(f"sm context={context_sms} device={sms.value}")
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    _check("cuModuleLoadData", cuda.cuModuleLoadData(ctypes.byref(module), PTX + b"\0"))
    _check("cuModuleGetFunction", cuda.cuModuleGetFunction(ctypes.byref(function), module, b"busy"))
    blocks = sms.value * BLOCKS_PER_SM
    out = ctypes.c_uint64()
    _check(
        "cuMemAlloc",
        cuda.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(blocks * THREADS_PER_BLOCK * 4)),
    )
    iterations = ctypes.c_uint32(ITERATIONS)
    params = (ctypes.c_void_p * 2)(
        ctypes.cast(ctypes.byref(out), ctypes.c_void_p),
        ctypes.cast(ctypes.byref(iterations), ctypes.c_void_p),
    )

    def launch() -> None:
        _check(
            "cuLaunchKernel",
            cuda.cuLaunchKernel(
                function, blocks, 1, 1, THREADS_PER_BLOCK, 1, 1, 0, None, params, None
            ),
        )
        _check("cuCtxSynchronize", cuda.cuCtxSynchronize())

    launch()  # the first launch loads the module onto the GPU: not counted
    say("ready")
    sys.stdin.readline()
    launches, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        launch()
        launches += 1
    say(f"busy launches={launches} seconds={time.monotonic() - start:.3f}")
    cuda.cuMemFree_v2(out)
    say("done")


def main(argv: list[str]) -> int:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        print(f"error load-libcuda {err}", flush=True)
        return 4
    try:
        run(cuda, float(argv[0]))
    except CudaError as err:
        print(f"error {err.call} {err.result}", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
