"""Run the benchmarks: `python -m bench.run [--scenario ...] [--reference PATH]`.

Starts a private control plane (hack/local-cluster.sh on free ports), a fake Node, and
plays the kubelet towards each plugin's sockets. This driver always runs; the Go
reference kubelet plugin (hack/build-reference.sh builds it) runs when its binary is
given (`--reference` or `GPU_DRA_REFERENCE_PLUGIN`), unthrottled and as shipped;
NVIDIA's gpu-kubelet-plugin, unthrottled, over NVIDIA's mock NVML, when both are given
(`--nvidia-plugin` and `--nvidia-nvml-root`; docs/benchmarks.md says how to build
them). The drivers take turns, one repetition of every scenario each (A B C A B C ...),
on the same node and cluster. Results: bench/results/<date>.json (`<date>-2.json`, ... for a
later run of the same day); `python -m bench.report` turns them into the tables of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import scenarios as sc
from bench.cluster import Api, LocalCluster, ensure_node
from bench.plugins import DRIVER, NVIDIA_DRIVER, NVML_LIBRARY
from bench.provenance import fsync_floor, machine, nvidia_build, reference_build
from bench.report import markdown
from bench.runner import SCENARIOS, UNTHROTTLED, Runner

# Turn order within a repetition: the fair comparisons first.
DRIVERS = ("ours", "reference_unthrottled", "nvidia", "reference")
# Scenarios that need this driver's metrics or mock controls (or its MIG fleet).
OURS_ONLY = ("permanent", "xid", "mig", "mig64")
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


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
    p.add_argument(
        "--nvidia-plugin",
        default=os.environ.get("GPU_DRA_NVIDIA_PLUGIN"),
        help="NVIDIA's gpu-kubelet-plugin binary (env GPU_DRA_NVIDIA_PLUGIN)",
    )
    p.add_argument(
        "--nvidia-nvml-root",
        default=os.environ.get("GPU_DRA_NVIDIA_NVML_ROOT"),
        help=f"the directory of NVIDIA's mock NVML {NVML_LIBRARY} (env GPU_DRA_NVIDIA_NVML_ROOT)",
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
    nvidia: dict[str, Any]
    unavailable = nvidia_unavailable(args.nvidia_plugin, args.nvidia_nvml_root)
    if unavailable:
        nvidia = {"note": unavailable}
    else:
        nvidia = nvidia_build(args.nvidia_plugin, args.nvidia_nvml_root)
        nvidia["flags"] = list(UNTHROTTLED)
        selected = args.scenario or SCENARIOS
        nvidia["skipped"] = {s: "this driver only" for s in OURS_ONLY if s in selected}
    print(f"NVIDIA's plugin: {nvidia}", flush=True)
    drivers = turn_order(
        reference=bool(args.reference),
        shipped_reference=not args.no_shipped_reference,
        nvidia=not unavailable,
    )

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
        "nvidia": nvidia,
        "runs": [],
    }
    try:
        api = Api(kubeconfig)
        ensure_node(api)
        sc.setup_namespace(api, (DRIVER, NVIDIA_DRIVER) if "nvidia" in drivers else (DRIVER,))
        runner = Runner(args, api, kubeconfig, work)
        if runner.want("floor"):
            results["floor"] = fsync_floor(work / "floor")
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


def nvidia_unavailable(plugin: str | None, nvml_root: str | None) -> str | None:
    """Why NVIDIA's plugin cannot take part in this run, or None when it can."""
    if not plugin:
        return "not available (give --nvidia-plugin PATH or GPU_DRA_NVIDIA_PLUGIN)"
    if not os.access(plugin, os.X_OK):
        return f"not available ({plugin} is not an executable file)"
    if not nvml_root:
        return (
            "not available (give --nvidia-nvml-root DIR or GPU_DRA_NVIDIA_NVML_ROOT, "
            "the directory of NVIDIA's mock NVML)"
        )
    if not (Path(nvml_root) / NVML_LIBRARY).is_file():
        return f"not available (no {NVML_LIBRARY} in {nvml_root})"
    return None


def turn_order(*, reference: bool, shipped_reference: bool, nvidia: bool) -> list[str]:
    """The drivers of one repetition, in turn order."""
    taking_part = {
        "ours": True,
        "reference_unthrottled": reference,
        "nvidia": nvidia,
        "reference": reference and shipped_reference,
    }
    return [d for d in DRIVERS if taking_part[d]]


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


if __name__ == "__main__":
    sys.exit(main())
