"""Run the benchmarks: `python -m bench.run [--scenario ...] [--reference PATH]`.

Starts a private control plane (hack/local-cluster.sh on free ports), a fake Node, and
plays the kubelet towards each plugin's sockets. This driver always runs; the Go
reference kubelet plugin (hack/build-reference.sh builds it) runs when its binary is
given (`--reference` or `GPU_DRA_REFERENCE_PLUGIN`), unthrottled and as shipped. The
drivers take turns, one repetition of every scenario each (A B C A B C ...), on the
same node and cluster. Results: bench/results/<date>.json (`<date>-2.json`, ... for a
later run of the same day); `python -m bench.report` turns them into the tables of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench import scenarios as sc
from bench.cluster import NODE_NAME, Api, BenchError, LocalCluster, ensure_node
from bench.plugins import OursPlugin, PluginUnderTest, ReferencePlugin
from bench.report import markdown
from tests.conftest import free_ports

SCENARIOS = (
    "prepare",
    "batch",
    "permanent",
    "xid",
    "mig",
    "resync",
    "restart",
    "publish64",
    "mig64",
    "floor",
)
# Turn order within a repetition: the fair comparison first.
DRIVERS = ("ours", "reference_unthrottled", "reference")
UNTHROTTLED = ("--kube-api-qps=1000", "--kube-api-burst=1000")
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# A dynamic MIG partition of the default fleet (1g.10gb at placement 0 of GPU 1) and the
# whole GPU 2, which on a MIG GPU is delivered as a full-size MIG device.
MIG_PARTITION = "gpu-1-mig-1g10gb-0"
MIG_WHOLE_GPU = "gpu-2"


def machine(path: Path) -> dict[str, Any]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    fs = subprocess.run(
        ["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "-T", str(path)], capture_output=True, text=True
    ).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "bench_dir_filesystem": fs,
        "bench_dir": str(path),
    }


class Runner:
    def __init__(self, args: argparse.Namespace, api: Api, kubeconfig: Path, work: Path) -> None:
        self.args = args
        self.api = api
        self.kubeconfig = kubeconfig
        self.work = work
        self.selected = set(args.scenario or SCENARIOS)
        self.watcher = sc.SliceWatcher(api, NODE_NAME).start()
        fleets = work / "fleets"
        fleets.mkdir(parents=True, exist_ok=True)
        self.fleet_example64 = fleets / "example-64.yaml"
        self.fleet_example64.write_text(
            yaml.safe_dump({"gpus": [{"model": "example", "count": 64}]})
        )
        self.fleet_h100_64 = fleets / "h100-64.yaml"
        self.fleet_h100_64.write_text(
            yaml.safe_dump({"gpus": [{"model": "H100-80GB", "count": 64}]})
        )
        self._claims: dict[str, sc.ClaimRef] = {}
        self._batch: list[sc.ClaimRef] = []
        self.pycache = work / "pycache"
        self.compile_bytecode()

    def compile_bytecode(self) -> None:
        """Compile the driver and its dependencies into the plugins' bytecode cache before
        anything is timed, as pip does at install: no start-up pays for compilation."""
        self.log("compiling bytecode for this driver's starts")
        roots = [str(REPO / "driver"), *sysconfig.get_paths()["purelib"].split(os.pathsep)]
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "-j", "0", *roots],
            env={**os.environ, "PYTHONPYCACHEPREFIX": str(self.pycache)},
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def want(self, name: str) -> bool:
        return name in self.selected

    def claim(self, name: str, device: str, config: Any = None) -> sc.ClaimRef:
        if name not in self._claims:
            self._claims[name] = sc.allocated_claim(self.api, NODE_NAME, name, device, config)
        return self._claims[name]

    def plugin(self, kind: str, phase: str, repetition: int) -> PluginUnderTest:
        root = self.work / f"{kind}-{repetition}" / phase
        if kind == "ours":
            port = free_ports(1)[0]
            return OursPlugin(root, self.kubeconfig, NODE_NAME, port, self.pycache)
        # "reference" runs with its defaults (client-side rate limit: 5 QPS, burst 10,
        # and it GETs every claim it prepares); "reference_unthrottled" without it.
        extra = UNTHROTTLED if kind == "reference_unthrottled" else ()
        return ReferencePlugin(
            Path(self.args.reference), root, self.kubeconfig, NODE_NAME, extra_args=extra
        )

    def gpus(self, kind: str, what: str) -> str:
        if kind == "ours":
            return {
                "8": "default",
                "64": str(self.fleet_example64),
                "mig64": str(self.fleet_h100_64),
            }[what]
        return what  # the reference: --num-devices

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def driver(self, kind: str, repetition: int) -> dict[str, Any]:
        """One repetition of every selected scenario for one driver."""
        out: dict[str, Any] = {}
        a = self.args
        ours = kind == "ours"
        # Phase A: 8 GPUs (ours: the default fleet, 8 H100 with every MIG placement).
        sc.delete_node_slices(self.api, NODE_NAME)
        plugin = self.plugin(kind, "8gpu", repetition)
        self.log(f"{kind} #{repetition}: start with 8 GPUs")
        kubelet, out["start_8gpu"] = sc.start_and_publish(
            plugin, self.gpus(kind, "8"), self.api, self.watcher
        )
        try:
            if ours and self.want("permanent"):
                bad = self.claim(
                    "bad-config",
                    "gpu-1",
                    {
                        "apiVersion": "gpu.resource.example.com/v1alpha1",
                        "kind": "GpuConfig",
                        "sharing": {
                            "strategy": "SpacePartitioning",
                            "spacePartitioningConfig": {"partitionCount": 64},
                        },
                    },
                )
                self.log(f"{kind}: permanent error x {a.iterations}")
                assert isinstance(plugin, OursPlugin)
                out["permanent_repeat"] = sc.permanent_error_repeats(
                    kubelet, plugin, bad, a.iterations
                )
            if ours and self.want("mig"):
                assert isinstance(plugin, OursPlugin)
                for key, name, device in (
                    ("mig_partition", "mig-partition", MIG_PARTITION),
                    ("mig_whole_gpu", "mig-whole-gpu", MIG_WHOLE_GPU),
                ):
                    ref = self.claim(name, device)
                    sc.prepare_single(kubelet, ref, 2)  # warm-up
                    self.log(f"{kind}: {device} (dynamic MIG) x {a.mig_iterations}")
                    out[key] = sc.mig_cycles(kubelet, plugin, ref, a.mig_iterations)
            if ours and self.want("xid"):
                self.log(f"{kind}: {a.xid_injections} Xid injections")
                assert isinstance(plugin, OursPlugin)
                out["xid_to_taint"] = sc.xid_to_taint(plugin, self.watcher, a.xid_injections)
            out["rss_kib_8gpu"] = plugin.rss_kib()
            if self.want("resync"):
                out["resync_8gpu"] = sc.resync_writes(plugin, self.api, self.watcher)
            if self.want("restart"):
                self.log(f"{kind}: restart with the slices in place")
                kubelet, out["restart_8gpu"] = sc.restart_writes(
                    plugin, self.gpus(kind, "8"), self.api, self.watcher, kubelet
                )
        finally:
            plugin.stop()
            kubelet.stop()

        # Phase B: 64 whole GPUs (ours: 64 `example` GPUs, the reference's device
        # model): the like-for-like prepare rows.
        if self.want("prepare") or self.want("batch") or self.want("publish64"):
            sc.delete_node_slices(self.api, NODE_NAME)
            plugin = self.plugin(kind, "64gpu", repetition)
            self.log(f"{kind}: start with 64 GPUs")
            kubelet, out["start_64gpu"] = sc.start_and_publish(
                plugin, self.gpus(kind, "64"), self.api, self.watcher
            )
            try:
                single = self.claim("single", "gpu-0")
                sc.prepare_single(kubelet, single, 5)  # warm-up
                if self.want("prepare"):
                    self.log(f"{kind}: 1 claim x {a.iterations}")
                    before = plugin.handler_seconds() if isinstance(plugin, OursPlugin) else None
                    out["prepare_1"] = sc.prepare_single(kubelet, single, a.iterations)
                    if isinstance(plugin, OursPlugin) and before is not None:
                        (s0, n0), (s1, n1) = before, plugin.handler_seconds()
                        out["prepare_1"]["handler_mean_ms"] = round((s1 - s0) / (n1 - n0) * 1e3, 3)
                if self.want("batch"):
                    if not self._batch:
                        self._batch = [self.claim(f"batch-{i}", f"gpu-{i}") for i in range(64)]
                    sc.prepare_batch(kubelet, self._batch, 1)  # warm-up
                    rounds = a.batch_rounds if kind != "reference" else a.throttled_batch_rounds
                    self.log(f"{kind}: 64-claim batch x {rounds}")
                    out["prepare_64"] = sc.prepare_batch(kubelet, self._batch, rounds)
                out["rss_kib_64gpu"] = plugin.rss_kib()
                if self.want("resync"):
                    out["resync_64gpu"] = sc.resync_writes(plugin, self.api, self.watcher)
            finally:
                plugin.stop()
                kubelet.stop()

        # Phase C (this driver only): 64 H100 with every MIG placement.
        if ours and self.want("mig64"):
            sc.delete_node_slices(self.api, NODE_NAME)
            plugin = self.plugin(kind, "mig64", repetition)
            self.log(f"{kind}: start with 64 MIG-capable GPUs")
            kubelet, out["start_mig64"] = sc.start_and_publish(
                plugin, self.gpus(kind, "mig64"), self.api, self.watcher
            )
            try:
                out["rss_kib_mig64"] = plugin.rss_kib()
                if self.want("resync"):
                    out["resync_mig64"] = sc.resync_writes(plugin, self.api, self.watcher)
            finally:
                plugin.stop()
                kubelet.stop()
        return out


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="python -m bench.run", description=doc.splitlines()[0])
    p.add_argument(
        "--scenario", action="append", choices=SCENARIOS, help="repeatable; default: all"
    )
    p.add_argument(
        "--reference",
        default=os.environ.get("GPU_DRA_REFERENCE_PLUGIN"),
        help="the Go reference kubelet plugin binary (env GPU_DRA_REFERENCE_PLUGIN)",
    )
    p.add_argument("--kubeconfig", help="use this running cluster instead of starting one")
    p.add_argument("--repetitions", type=int, default=3, help="turns of every driver")
    p.add_argument(
        "--iterations",
        type=int,
        default=100,
        help="single-claim prepares (and permanent-error repeats) per repetition",
    )
    p.add_argument("--mig-iterations", type=int, default=30, help="per MIG device and repetition")
    p.add_argument("--batch-rounds", type=int, default=20, help="per repetition")
    p.add_argument(
        "--throttled-batch-rounds",
        type=int,
        default=2,
        help="per repetition for the reference as shipped (about 13 s a round)",
    )
    p.add_argument("--xid-injections", type=int, default=70, help="per repetition")
    p.add_argument(
        "--no-shipped-reference",
        action="store_true",
        help="skip the reference with its default client rate limit",
    )
    p.add_argument(
        "--out", type=Path, default=RESULTS, help="directory of <date>.json (never overwritten)"
    )
    p.add_argument("--plot", type=Path, help="write the prepare-latency PNG here")
    args = p.parse_args(argv)

    reference: dict[str, Any]
    if args.reference and not os.access(args.reference, os.X_OK):
        reference = {"note": f"not available ({args.reference} is not an executable file)"}
        args.reference = None
    elif not args.reference:
        reference = {"note": "not available (give --reference PATH or GPU_DRA_REFERENCE_PLUGIN)"}
    else:
        reference = reference_build(args.reference)
    print(f"reference: {reference}", flush=True)
    drivers = [
        d
        for d in DRIVERS
        if d == "ours" or (args.reference and not (d == "reference" and args.no_shipped_reference))
    ]

    work = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-work-"))
    cluster = None
    if args.kubeconfig:
        kubeconfig = Path(args.kubeconfig)
    else:
        print("starting a private control plane (hack/local-cluster.sh up) ...", flush=True)
        cluster = LocalCluster.start()
        kubeconfig = cluster.kubeconfig
    started = dt.datetime.now(dt.UTC)
    results: dict[str, Any] = {
        "started": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", "-m", "bench.run", *(argv or sys.argv[1:])]),
        "machine": machine(work),
        "load": {"start": sc.load_average()},
        "parameters": {
            "repetitions": args.repetitions,
            "iterations": args.iterations,
            "mig_iterations": args.mig_iterations,
            "batch_rounds": args.batch_rounds,
            "throttled_batch_rounds": args.throttled_batch_rounds,
            "xid_injections": args.xid_injections,
            "scenarios": sorted(args.scenario or SCENARIOS),
        },
        "reference": reference,
        "runs": [],
    }
    try:
        api = Api(kubeconfig)
        ensure_node(api)
        sc.setup_namespace(api)
        runner = Runner(args, api, kubeconfig, work)
        if runner.want("floor"):
            results["floor"] = sc.fsync_floor(work / "floor")
        for repetition in range(1, args.repetitions + 1):
            for kind in drivers:
                load_before = sc.load_average()
                t0 = time.monotonic()
                out = runner.driver(kind, repetition)
                results["runs"].append(
                    {
                        "driver": kind,
                        "repetition": repetition,
                        "seconds": round(time.monotonic() - t0, 1),
                        "load_start": load_before,
                        "load_end": sc.load_average(),
                        "results": out,
                    }
                )
        runner.watcher.stop()
    finally:
        if cluster is not None:
            cluster.stop()
    results["load"]["end"] = sc.load_average()
    results["finished"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    path = new_results_path(args.out, started)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(markdown(results))
    print(f"results: {path}")
    if args.plot:
        from bench.plot import plot

        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


def new_results_path(directory: Path, started: dt.datetime, prefix: str = "") -> Path:
    """`<prefix><date>.json` in `directory`, or `<prefix><date>-2.json`, `-3`, ... when a
    run of the same day is there already: committed results are never overwritten."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{prefix}{started:%Y-%m-%d}.json"
    suffix = 2
    while path.exists():
        path = directory / f"{prefix}{started:%Y-%m-%d}-{suffix}.json"
        suffix += 1
    return path


def reference_build(binary: str) -> dict[str, Any]:
    """What the reference binary was built from, as its Go build info says."""
    out = subprocess.run(["go", "version", "-m", binary], capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchError(f"go version -m {binary}: {out.stderr.strip()}")
    info: dict[str, Any] = {"binary": binary, "built_by": "hack/build-reference.sh"}
    for line in out.stdout.splitlines():
        fields = line.split()
        if line.startswith(f"{binary}:"):
            info["go"] = fields[-1]
        elif fields[:1] == ["path"]:
            info["package"] = fields[1]
        elif fields[:1] == ["mod"]:
            info["module"], info["version"] = fields[1], fields[2]
    if "version" not in info:
        raise BenchError(f"go version -m {binary} names no module version")
    return info


if __name__ == "__main__":
    sys.exit(main())
