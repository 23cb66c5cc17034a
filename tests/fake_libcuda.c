/* A stand-in libcuda.so.1 for tests/gpu/cuda_bound.py in a container on a machine
 * without a GPU (tests/integration/test_mps_containers_mock.py): the calls it makes,
 * answering as an MPS client under the pinned limit its container's environment
 * names (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<n>M, from the claim's CDI edits), with a
 * context of 271 MiB inside it (docs/mps.md); without that variable, the whole
 * 143771 MiB of an H200. An allocation above what is free fails with
 * CUDA_ERROR_OUT_OF_MEMORY (2). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define MIB ((size_t)1 << 20)
#define GPU_MIB 143771
#define CONTEXT_MIB 271

static size_t used;

static size_t limit(void) {
  const char *value = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
  const char *number = value ? strchr(value, '=') : NULL;
  return (number ? strtoull(number + 1, NULL, 10) : GPU_MIB) * MIB;
}

int cuInit(unsigned flags) { return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuCtxCreate_v2(void **context, unsigned flags, int device) {
  *context = &used;
  used = CONTEXT_MIB * MIB;
  return 0;
}
int cuMemGetInfo_v2(size_t *free, size_t *total) {
  *free = limit() - used;
  *total = GPU_MIB * MIB;
  return 0;
}
int cuDeviceGetAttribute(int *value, int attribute, int device) { *value = 132; return 0; }
int cuCtxGetExecAffinity(unsigned *param, int type) { param[1] = 132; return 0; }
int cuMemAlloc_v2(unsigned long long *pointer, size_t size) {
  if (size > limit() - used) return 2;
  used += size;
  *pointer = 0x7f0000000000ull;
  return 0;
}
int cuMemFree_v2(unsigned long long pointer) { used = CONTEXT_MIB * MIB; return 0; }
