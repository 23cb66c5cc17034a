// The per-node CPU cost of kube-scheduler's DRA allocator over this driver's
// ResourceSlices: bench/allocator.py writes the input (one layout's slices for N
// nodes, the chart's DeviceClasses and one claim) and reads the one JSON line this
// prints. The allocator is the scheduler's own (k8s.io/dynamic-resource-allocation,
// the version go.mod pins, the feature set of the local cluster's kube-scheduler),
// so the figures are the work the DynamicResources filter does per node checked.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
)

type input struct {
	Slices  []resourceapi.ResourceSlice `json:"slices"`
	Classes []resourceapi.DeviceClass   `json:"classes"`
	Claim   resourceapi.ResourceClaim   `json:"claim"`
	Nodes   []string                    `json:"nodes"`
}

type result struct {
	MedianMicros   float64 `json:"allocateMicrosPerNodeMedian"`
	FastestMicros  float64 `json:"allocateMicrosPerNodeFastest"`
	NewAllocator   float64 `json:"newAllocatorMicros"`
	KiBPerNode     float64 `json:"allocatedKiBPerNode"`
	MallocsPerNode uint64  `json:"mallocsPerNode"`
	Device         string  `json:"device"`
	Rounds         int     `json:"rounds"`
	Nodes          int     `json:"nodes"`
}

type classLister map[string]*resourceapi.DeviceClass

func (l classLister) List() ([]*resourceapi.DeviceClass, error) {
	out := make([]*resourceapi.DeviceClass, 0, len(l))
	for _, c := range l {
		out = append(out, c)
	}
	return out, nil
}

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	if c, ok := l[name]; ok {
		return c, nil
	}
	return nil, fmt.Errorf("no DeviceClass %s", name)
}

func main() {
	file := flag.String("in", "", "input JSON written by bench/allocator.py")
	rounds := flag.Int("rounds", 40, "rounds over every node")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the timed rounds to this file")
	memProfile := flag.String("memprofile", "", "write an allocation profile (every allocation sampled) to this file")
	flag.Parse()
	if *memProfile != "" {
		runtime.MemProfileRate = 1
	}
	if err := run(*file, *rounds, profiles{cpu: *cpuProfile, mem: *memProfile}); err != nil {
		fmt.Fprintln(os.Stderr, "allocator:", err)
		os.Exit(1)
	}
}

// profiles names the pprof files to write ("": none). The CPU profile covers the
// timed rounds only (NewAllocator and Allocate), not reading the input.
type profiles struct {
	cpu, mem string
}

func run(file string, rounds int, prof profiles) error {
	if rounds < 1 {
		return fmt.Errorf("-rounds: %d, at least 1", rounds)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	var in input
	if err := json.Unmarshal(data, &in); err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	if len(in.Nodes) == 0 {
		return fmt.Errorf("%s: nodes: none", file)
	}
	pool := make([]*resourceapi.ResourceSlice, len(in.Slices))
	for i := range in.Slices {
		s := &in.Slices[i]
		s.Name = fmt.Sprintf("%s%04d", s.GenerateName, i)
		pool[i] = s
	}
	classes := classLister{}
	for i := range in.Classes {
		classes[in.Classes[i].Name] = &in.Classes[i]
	}
	in.Claim.UID = "bench-claim"
	in.Claim.Namespace = "bench"
	features := structured.Features{
		AdminAccess: true, PrioritizedList: true, PartitionableDevices: true, DeviceTaints: true,
		DeviceBindingAndStatus: true, ConsumableCapacity: true, FractionalCapacityRange: true,
	}
	cache := cel.NewCache(10, cel.Features{EnableConsumableCapacity: true})
	state := structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
	nodes := make([]*v1.Node, len(in.Nodes))
	for i, name := range in.Nodes {
		nodes[i] = &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	}
	ctx := context.Background()
	claims := []*resourceapi.ResourceClaim{&in.Claim}
	out := result{Rounds: rounds, Nodes: len(nodes)}
	perNode := make([]float64, 0, rounds)
	var before, after runtime.MemStats
	var newAllocator time.Duration
	if prof.cpu != "" {
		f, err := os.Create(prof.cpu)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
	}
	for r := 0; r < rounds; r++ {
		started := time.Now()
		alloc, err := structured.NewAllocator(ctx, features, state, classes, pool, cache)
		if err != nil {
			return err
		}
		newAllocator += time.Since(started)
		runtime.ReadMemStats(&before)
		cpu := cpuNanos()
		for _, node := range nodes {
			res, err := alloc.Allocate(ctx, node, claims)
			if err != nil || len(res) != 1 {
				return fmt.Errorf("node %s: no allocation (%v)", node.Name, err)
			}
			out.Device = res[0].Devices.Results[0].Device
		}
		perNode = append(perNode, float64(cpuNanos()-cpu)/float64(len(nodes))/1000)
		runtime.ReadMemStats(&after)
	}
	if prof.cpu != "" {
		pprof.StopCPUProfile()
	}
	if prof.mem != "" {
		if err := writeHeapProfile(prof.mem); err != nil {
			return err
		}
	}
	slices.Sort(perNode)
	out.MedianMicros = perNode[len(perNode)/2]
	out.FastestMicros = perNode[0]
	out.NewAllocator = float64(newAllocator.Microseconds()) / float64(rounds)
	out.KiBPerNode = float64(after.TotalAlloc-before.TotalAlloc) / float64(len(nodes)) / 1024
	out.MallocsPerNode = (after.Mallocs - before.Mallocs) / uint64(len(nodes))
	return json.NewEncoder(os.Stdout).Encode(out)
}

// writeHeapProfile writes every allocation since the start (input decoding too:
// `go tool pprof -focus=Allocate` keeps the allocator's). The profile reflects the
// last completed GC, hence one first.
func writeHeapProfile(path string) error {
	runtime.GC()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return pprof.Lookup("allocs").WriteTo(f, 0)
}

// cpuNanos is the process's CPU time (the GC's workers included): steadier than the
// wall clock on a machine that runs other work.
func cpuNanos() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_PROCESS_CPUTIME_ID, &ts); err != nil {
		panic(err)
	}
	return ts.Nano()
}
