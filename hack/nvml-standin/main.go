// nvml-standin is a test stand-in for libnvidia-ml.so.1, for NVIDIA's Go CDI generator
// only: `nvidia-ctk cdi generate --mode nvml` and our cmd/gpu-dra-cdi-common (both
// nvcdi of the NVIDIA Container Toolkit, through go-nvml) on a fake driver root in
// tests/integration/test_cdi_generator.py. It is NOT the driver's own mock NVML (that
// one is Python, driver/nvml) and has nothing to do with real hardware.
//
// Built with `go build -buildmode=c-shared` (hack/build-nvml-standin.sh) into
// libnvidia-ml.so; the test copies it into the fake root as libnvidia-ml.so.<version>,
// where nvcdi finds it as libnvidia-ml.so.1 and go-nvml dlopens it.
//
// It answers from a fixed table: NVML_STANDIN_GPU_COUNT (default 2, at most 8) A100
// GPUs, minor numbers 0..n-1, MIG capable but disabled, driver version
// NVML_STANDIN_DRIVER_VERSION (default 580.95.05, the tests' fake root).
//
// The entry points are exactly those nvcdi calls in nvml mode (found with
// NVML_STANDIN_TRACE=1, which logs every call on stderr), with the C signatures of
// go-nvml's nvml.h (v0.13.4-1). go-nvml binds symbols lazily, so a call to one not
// exported here would end the caller with "symbol lookup error: undefined symbol"; it
// picks the newest versioned name it finds (updateVersionedSymbols: nvmlInit_v2,
// nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetPciInfo_v3), and
// go-nvlib treats MIG as unsupported unless nvmlDeviceGetMigMode exists.
//
//   - nvmlInit_v2, nvmlShutdown, nvmlSystemGetDriverVersion: nvcdi's driver version
//     (all gpu-dra-cdi-common's GetCommonEdits asks), which selects the driver's files;
//   - nvmlErrorString: go-nvml's text for a failed call, e.g. in nvidia-ctk's errors;
//   - nvmlDeviceGetCount_v2, nvmlDeviceGetHandleByIndex_v2, nvmlDeviceGetName (go-nvlib's
//     skip list), nvmlDeviceGetUUID, nvmlDeviceGetHandleByUUID, nvmlDeviceGetMinorNumber
//     (/dev/nvidiaN), nvmlDeviceGetPciInfo_v3 (DRM nodes, by-path links): nvidia-ctk's
//     device specs, one per GPU;
//   - nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount,
//     nvmlDeviceGetMigDeviceHandleByIndex: MIG capable, disabled, no MIG devices;
//   - nvmlDeviceIsMigDeviceHandle, nvmlDeviceGetIndex: nvidia-ctk --device-id.
//
// Errors are NVML's: NVML_ERROR_UNINITIALIZED before nvmlInit, INVALID_ARGUMENT for a
// handle or index not in the table, NOT_FOUND for an unknown UUID or a MIG device,
// INSUFFICIENT_SIZE for a short buffer. No call panics.
package main

/*
#include <stdlib.h>

// The few nvml.h types used here, laid out as in go-nvml's nvml.h.
typedef int nvmlReturn_t;
struct nvmlDevice_st { unsigned int index; };
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlPciInfo_st {
	char busIdLegacy[16];
	unsigned int domain;
	unsigned int bus;
	unsigned int device;
	unsigned int pciDeviceId;
	unsigned int pciSubSystemId;
	char busId[32];
} nvmlPciInfo_t;
*/
import "C"

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"unsafe"
)

// nvmlReturn_t values (nvml.h).
const (
	success             = 0
	errUninitialized    = 1
	errInvalidArgument  = 2
	errNotSupported     = 3
	errNotFound         = 6
	errInsufficientSize = 7
)

const (
	defaultDriverVersion = "580.95.05"
	defaultGPUCount      = 2
	maxGPUs              = 8
	gpuName              = "NVIDIA A100-SXM4-40GB"
	pciDeviceID          = 0x20B010DE // device 0x20b0, vendor 0x10de
	pciSubSystemID       = 0x134F10DE
	maxMigDevices        = 7
	migDisabled          = 0
)

// The PCI buses of a DGX A100's GPUs, in NVML's index order.
var pciBuses = [maxGPUs]uint{0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD}

var (
	mu       sync.Mutex
	initRefs int
	handles  []C.nvmlDevice_t // C memory: go-nvml keeps the handles in Go pointers
	errTexts = map[C.nvmlReturn_t]*C.char{}
)

// trace logs a call on stderr when NVML_STANDIN_TRACE is set: which entry points a
// caller uses.
func trace(name string) {
	if os.Getenv("NVML_STANDIN_TRACE") != "" {
		fmt.Fprintf(os.Stderr, "nvml-standin: %s\n", name)
	}
}

func gpuCount() int {
	n, err := strconv.Atoi(os.Getenv("NVML_STANDIN_GPU_COUNT"))
	if err != nil || n < 0 || n > maxGPUs {
		return defaultGPUCount
	}
	return n
}

func driverVersion() string {
	if v := os.Getenv("NVML_STANDIN_DRIVER_VERSION"); v != "" {
		return v
	}
	return defaultDriverVersion
}

func uuid(i int) string {
	return fmt.Sprintf("GPU-5e1d0a%02x-7c3b-4f7e-9b2a-0d6c8e4f%04x", i, 0xa100+i)
}

// device returns the table index of a handle, or -1 if it is not one of ours.
func device(d C.nvmlDevice_t) int {
	for i, h := range handles {
		if h == d {
			return i
		}
	}
	return -1
}

// putString copies s, NUL-terminated, into the caller's buffer of n bytes.
func putString(dst *C.char, n C.uint, s string) C.nvmlReturn_t {
	if dst == nil {
		return errInvalidArgument
	}
	if uint(len(s))+1 > uint(n) {
		return errInsufficientSize
	}
	buf := unsafe.Slice((*byte)(unsafe.Pointer(dst)), int(n))
	copy(buf, s)
	buf[len(s)] = 0
	return success
}

func initialized() bool {
	mu.Lock()
	defer mu.Unlock()
	return initRefs > 0
}

// check validates a device handle: NVML_SUCCESS and its index, or an error.
func check(d C.nvmlDevice_t) (int, C.nvmlReturn_t) {
	if !initialized() {
		return -1, errUninitialized
	}
	i := device(d)
	if i < 0 {
		return -1, errInvalidArgument
	}
	return i, success
}

//export nvmlInit_v2
func nvmlInit_v2() C.nvmlReturn_t {
	trace("nvmlInit_v2")
	mu.Lock()
	defer mu.Unlock()
	if handles == nil {
		for i := range gpuCount() {
			h := (C.nvmlDevice_t)(C.malloc(C.size_t(unsafe.Sizeof(C.struct_nvmlDevice_st{}))))
			h.index = C.uint(i)
			handles = append(handles, h)
		}
	}
	initRefs++
	return success
}

//export nvmlShutdown
func nvmlShutdown() C.nvmlReturn_t {
	trace("nvmlShutdown")
	mu.Lock()
	defer mu.Unlock()
	if initRefs == 0 {
		return errUninitialized
	}
	initRefs--
	return success
}

//export nvmlErrorString
func nvmlErrorString(result C.nvmlReturn_t) *C.char {
	trace("nvmlErrorString")
	mu.Lock()
	defer mu.Unlock()
	if s, ok := errTexts[result]; ok {
		return s
	}
	text := map[C.nvmlReturn_t]string{
		success:             "Success",
		errUninitialized:    "Uninitialized",
		errInvalidArgument:  "Invalid Argument",
		errNotSupported:     "Not Supported",
		errNotFound:         "Not Found",
		errInsufficientSize: "Insufficient Size",
	}[result]
	if text == "" {
		text = "Unknown Error"
	}
	s := C.CString(text) // kept for the life of the process, as NVML's are
	errTexts[result] = s
	return s
}

//export nvmlSystemGetDriverVersion
func nvmlSystemGetDriverVersion(version *C.char, length C.uint) C.nvmlReturn_t {
	trace("nvmlSystemGetDriverVersion")
	if !initialized() {
		return errUninitialized
	}
	return putString(version, length, driverVersion())
}

//export nvmlDeviceGetCount_v2
func nvmlDeviceGetCount_v2(count *C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceGetCount_v2")
	if !initialized() {
		return errUninitialized
	}
	if count == nil {
		return errInvalidArgument
	}
	*count = C.uint(len(handles))
	return success
}

//export nvmlDeviceGetHandleByIndex_v2
func nvmlDeviceGetHandleByIndex_v2(index C.uint, d *C.nvmlDevice_t) C.nvmlReturn_t {
	trace("nvmlDeviceGetHandleByIndex_v2")
	if !initialized() {
		return errUninitialized
	}
	if d == nil || int(index) >= len(handles) {
		return errInvalidArgument
	}
	*d = handles[index]
	return success
}

//export nvmlDeviceGetHandleByUUID
func nvmlDeviceGetHandleByUUID(id *C.char, d *C.nvmlDevice_t) C.nvmlReturn_t {
	trace("nvmlDeviceGetHandleByUUID")
	if !initialized() {
		return errUninitialized
	}
	if id == nil || d == nil {
		return errInvalidArgument
	}
	want := C.GoString(id)
	for i, h := range handles {
		if uuid(i) == want {
			*d = h
			return success
		}
	}
	return errNotFound
}

//export nvmlDeviceGetName
func nvmlDeviceGetName(d C.nvmlDevice_t, name *C.char, length C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceGetName")
	if _, ret := check(d); ret != success {
		return ret
	}
	return putString(name, length, gpuName)
}

//export nvmlDeviceGetUUID
func nvmlDeviceGetUUID(d C.nvmlDevice_t, id *C.char, length C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceGetUUID")
	i, ret := check(d)
	if ret != success {
		return ret
	}
	return putString(id, length, uuid(i))
}

//export nvmlDeviceGetIndex
func nvmlDeviceGetIndex(d C.nvmlDevice_t, index *C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceGetIndex")
	i, ret := check(d)
	if ret != success {
		return ret
	}
	if index == nil {
		return errInvalidArgument
	}
	*index = C.uint(i)
	return success
}

//export nvmlDeviceGetMinorNumber
func nvmlDeviceGetMinorNumber(d C.nvmlDevice_t, minor *C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceGetMinorNumber")
	return nvmlDeviceGetIndex(d, minor) // /dev/nvidia<index>
}

//export nvmlDeviceGetPciInfo_v3
func nvmlDeviceGetPciInfo_v3(d C.nvmlDevice_t, pci *C.nvmlPciInfo_t) C.nvmlReturn_t {
	trace("nvmlDeviceGetPciInfo_v3")
	i, ret := check(d)
	if ret != success {
		return ret
	}
	if pci == nil {
		return errInvalidArgument
	}
	bus := pciBuses[i]
	*pci = C.nvmlPciInfo_t{}
	pci.domain, pci.bus, pci.device = 0, C.uint(bus), 0
	pci.pciDeviceId, pci.pciSubSystemId = pciDeviceID, pciSubSystemID
	putString(&pci.busIdLegacy[0], C.uint(len(pci.busIdLegacy)), fmt.Sprintf("%04X:%02X:00.0", 0, bus))
	putString(&pci.busId[0], C.uint(len(pci.busId)), fmt.Sprintf("%08X:%02X:00.0", 0, bus))
	return success
}

//export nvmlDeviceGetMigMode
func nvmlDeviceGetMigMode(d C.nvmlDevice_t, current, pending *C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceGetMigMode")
	if _, ret := check(d); ret != success {
		return ret
	}
	if current == nil || pending == nil {
		return errInvalidArgument
	}
	*current, *pending = migDisabled, migDisabled
	return success
}

//export nvmlDeviceGetMaxMigDeviceCount
func nvmlDeviceGetMaxMigDeviceCount(d C.nvmlDevice_t, count *C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceGetMaxMigDeviceCount")
	if _, ret := check(d); ret != success {
		return ret
	}
	if count == nil {
		return errInvalidArgument
	}
	*count = maxMigDevices
	return success
}

//export nvmlDeviceGetMigDeviceHandleByIndex
func nvmlDeviceGetMigDeviceHandleByIndex(d C.nvmlDevice_t, index C.uint, mig *C.nvmlDevice_t) C.nvmlReturn_t {
	trace("nvmlDeviceGetMigDeviceHandleByIndex")
	if _, ret := check(d); ret != success {
		return ret
	}
	return errNotFound // MIG is disabled: no MIG devices
}

//export nvmlDeviceIsMigDeviceHandle
func nvmlDeviceIsMigDeviceHandle(d C.nvmlDevice_t, isMig *C.uint) C.nvmlReturn_t {
	trace("nvmlDeviceIsMigDeviceHandle")
	if _, ret := check(d); ret != success {
		return ret
	}
	if isMig == nil {
		return errInvalidArgument
	}
	*isMig = 0
	return success
}

func main() {}
