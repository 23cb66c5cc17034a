"""A stand-in for libcuda behind tests/gpu/cuda_bound.py's `Cuda`, for the tier's
logic on a machine without a GPU: a context of `context_mib` inside a pinned limit of
`limit_mib`, as an MPS client sees it (docs/mps.md: free = limit - context); an
allocation above what is free fails with CUDA_ERROR_OUT_OF_MEMORY. While it holds an
allocation the file `held` exists, so that a test can see two clients hold at once.

`python -c 'from tests.fake_cuda import serve; serve()' LIMIT_MIB MARGIN_MIB HELD` runs
cuda_bound's protocol on it in a process of its own."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.gpu.cuda_bound import CUDA_SUCCESS, CudaError, run

CUDA_ERROR_OUT_OF_MEMORY = 2
GPU_MIB = 143771
SMS = 132


@dataclass
class FakeCuda:
    limit_mib: int
    held: Path
    context_mib: int = 271
    context_error: int = CUDA_SUCCESS
    allocated: dict[int, int] = field(default_factory=dict)

    def open_context(self) -> None:
        if self.context_error != CUDA_SUCCESS:
            raise CudaError("cuCtxCreate", self.context_error)

    def _free_bytes(self) -> int:
        return ((self.limit_mib - self.context_mib) << 20) - sum(self.allocated.values())

    def memory(self) -> tuple[int, int]:
        return self._free_bytes(), GPU_MIB << 20

    def sm_counts(self) -> tuple[str, int]:
        return str(SMS // 2), SMS

    def alloc(self, size: int) -> tuple[int, int]:
        if size > self._free_bytes():
            return CUDA_ERROR_OUT_OF_MEMORY, 0
        pointer = 0x7F0000000000 + len(self.allocated) * 0x1000
        self.allocated[pointer] = size
        self.held.touch()
        return CUDA_SUCCESS, pointer

    def free(self, pointer: int) -> None:
        del self.allocated[pointer]
        if not self.allocated:
            self.held.unlink()


def serve() -> None:
    limit, margin, held = sys.argv[1:4]
    sys.exit(run(FakeCuda(int(limit), Path(held)), int(margin), sys.stdin, sys.stdout))
