"""Run the benchmarks: `python -m bench.run [--scenario ...] [--reference PATH]`.

Starts a private control plane (hack/local-cluster.sh on free ports), a fake Node, and
plays the kubelet towards each plugin's sockets. This driver always runs; the Go
reference kubelet plugin runs when its binary is given (`--reference` or
`GPU_DRA_REFERENCE_PLUGIN`), one plugin after the other on the same node and cluster.
Results: bench/results/<time>.json, latest.json, latest.md (and a PNG with --plot).
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench import scenarios as sc
from bench.cluster import NODE_NAME, Api, LocalCluster, ensure_node
from bench.plugins import OursPlugin, PluginUnderTest, ReferencePlugin
from bench.report import markdown
from tests.conftest import free_ports

SCENARIOS = (
    "prepare",
    "batch",
    "permanent",
    "xid",
    "resync",
    "restart",
    "publish64",
    "mig64",
    "floor",
)
UNTHROTTLED = ("--kube-api-qps=1000", "--kube-api-burst=1000")
RESULTS = Path(__file__).resolve().parent / "results"


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
        self._single: sc.ClaimRef | None = None
        self._batch: list[sc.ClaimRef] = []

    def want(self, name: str) -> bool:
        return name in self.selected

    def plugin(self, kind: str, phase: str) -> PluginUnderTest:
        root = self.work / kind / phase
        if kind == "ours":
            return OursPlugin(root, self.kubeconfig, NODE_NAME, free_ports(1)[0])
        # "reference" runs with its defaults (client-side rate limit: 5 QPS, burst 10,
        # and it GETs every claim it prepares); "reference_unthrottled" without it.
        extra = UNTHROTTLED if kind == "reference_unthrottled" else ()
        return ReferencePlugin(
            Path(self.args.reference), root, self.kubeconfig, NODE_NAME, extra_args=extra
        )

    def gpus(self, kind: str, what: str) -> str:
        table = {
            ("ours", "8"): "default",
            ("ours", "64"): str(self.fleet_example64),
            ("ours", "mig64"): str(self.fleet_h100_64),
            ("reference", "8"): "8",
            ("reference", "64"): "64",
            ("reference_unthrottled", "8"): "8",
            ("reference_unthrottled", "64"): "64",
        }
        return table[(kind, what)]

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def driver(self, kind: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        a = self.args
        # Phase A: 8 GPUs (ours: the default fleet, 8 H100 with every MIG placement).
        sc.delete_node_slices(self.api, NODE_NAME)
        plugin = self.plugin(kind, "8gpu")
        self.log(f"{kind}: start with 8 GPUs")
        kubelet, out["start_8gpu"] = sc.start_and_publish(
            plugin, self.gpus(kind, "8"), self.api, self.watcher
        )
        try:
            if self._single is None:
                self._single = sc.allocated_claim(self.api, NODE_NAME, "single", "gpu-0")
            for _ in range(5):  # warm-up
                sc.prepare_single(kubelet, self._single, 1)
            if self.want("prepare"):
                self.log(f"{kind}: 1 claim x {a.iterations}")
                out["prepare_1"] = sc.prepare_single(kubelet, self._single, a.iterations)
            if kind == "ours" and self.want("permanent"):
                bad = sc.allocated_claim(
                    self.api,
                    NODE_NAME,
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
            if kind == "ours" and self.want("xid"):
                self.log(f"{kind}: {a.xid_injections} Xid injections")
                assert isinstance(plugin, OursPlugin)
                out["xid_to_taint"] = sc.xid_to_taint(plugin, self.watcher, a.xid_injections)
            out["rss_kib_8gpu"] = plugin.rss_kib()
            if self.want("resync"):
                out["resync_8gpu"] = sc.resync_writes(plugin, self.api, self.watcher)
            if kind == "ours":
                out["api_writes_metric"] = plugin.metric("gpu_dra_api_writes")
            if self.want("restart"):
                self.log(f"{kind}: restart with the slices in place")
                kubelet, out["restart_8gpu"] = sc.restart_writes(
                    plugin, self.gpus(kind, "8"), self.api, self.watcher, kubelet
                )
        finally:
            plugin.stop()
            kubelet.stop()

        # Phase B: 64 whole GPUs (ours: 64 reference-compatible `example` GPUs).
        if self.want("batch") or self.want("publish64"):
            sc.delete_node_slices(self.api, NODE_NAME)
            plugin = self.plugin(kind, "64gpu")
            self.log(f"{kind}: start with 64 GPUs")
            kubelet, out["start_64gpu"] = sc.start_and_publish(
                plugin, self.gpus(kind, "64"), self.api, self.watcher
            )
            try:
                if self.want("batch"):
                    if not self._batch:
                        self._batch = [
                            sc.allocated_claim(self.api, NODE_NAME, f"batch-{i}", f"gpu-{i}")
                            for i in range(64)
                        ]
                    sc.prepare_batch(kubelet, self._batch, 1)  # warm-up
                    self.log(f"{kind}: 64-claim batch x {a.batch_rounds}")
                    out["prepare_64"] = sc.prepare_batch(kubelet, self._batch, a.batch_rounds)
                out["rss_kib_64gpu"] = plugin.rss_kib()
                if self.want("resync"):
                    out["resync_64gpu"] = sc.resync_writes(plugin, self.api, self.watcher)
            finally:
                plugin.stop()
                kubelet.stop()

        # Phase C (this driver only): 64 H100 with every MIG placement.
        if kind == "ours" and self.want("mig64"):
            sc.delete_node_slices(self.api, NODE_NAME)
            plugin = self.plugin(kind, "mig64")
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
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument(
        "--scenario", action="append", choices=SCENARIOS, help="repeatable; default: all"
    )
    p.add_argument(
        "--reference",
        default=os.environ.get("GPU_DRA_REFERENCE_PLUGIN"),
        help="the Go reference kubelet plugin binary (env GPU_DRA_REFERENCE_PLUGIN)",
    )
    p.add_argument("--kubeconfig", help="use this running cluster instead of starting one")
    p.add_argument(
        "--iterations",
        type=int,
        default=200,
        help="single-claim prepares (and permanent-error repeats)",
    )
    p.add_argument("--batch-rounds", type=int, default=10)
    p.add_argument("--xid-injections", type=int, default=50)
    p.add_argument(
        "--no-unthrottled",
        action="store_true",
        help="skip the second reference run with --kube-api-qps/--kube-api-burst 1000",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, help="write the prepare-latency PNG here")
    args = p.parse_args(argv)

    reference_note = None
    if args.reference and not os.access(args.reference, os.X_OK):
        reference_note = f"not available ({args.reference} is not an executable file)"
        args.reference = None
    elif not args.reference:
        reference_note = "not available (give --reference PATH or GPU_DRA_REFERENCE_PLUGIN)"
    print(f"reference: {reference_note or args.reference}", flush=True)

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
        "command": " ".join(
            [Path(sys.executable).name, "-m", "bench.run", *(argv or sys.argv[1:])]
        ),
        "machine": machine(work),
        "parameters": {
            "iterations": args.iterations,
            "batch_rounds": args.batch_rounds,
            "xid_injections": args.xid_injections,
            "scenarios": sorted(args.scenario or SCENARIOS),
        },
        "drivers": {},
    }
    try:
        api = Api(kubeconfig)
        ensure_node(api)
        sc.setup_namespace(api)
        runner = Runner(args, api, kubeconfig, work)
        if runner.want("floor"):
            results["floor"] = sc.fsync_floor(work / "floor")
        results["drivers"]["ours"] = runner.driver("ours")
        if args.reference:
            results["drivers"]["reference"] = runner.driver("reference")
            if not args.no_unthrottled:
                results["drivers"]["reference_unthrottled"] = runner.driver("reference_unthrottled")
            results["reference"] = {
                "binary": args.reference,
                "version": reference_version(args.reference),
            }
        else:
            results["reference"] = {"note": reference_note}
        runner.watcher.stop()
    finally:
        if cluster is not None:
            cluster.stop()

    args.out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    text = json.dumps(results, indent=1, sort_keys=True)
    (args.out / f"{stamp}.json").write_text(text)
    (args.out / "latest.json").write_text(text)
    table = markdown(results)
    (args.out / "latest.md").write_text(table)
    print(table)
    if args.plot:
        from bench.plot import plot

        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


def reference_version(binary: str) -> str:
    """The reference has no --version flag: the cache file name carries it."""
    match = re.search(r"v\d+\.\d+\.\d+\S*", Path(binary).name)
    if match:
        return match.group(0)
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
