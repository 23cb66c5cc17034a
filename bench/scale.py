"""Scheduler scale: the real kube-scheduler allocating one claim per pod against N nodes
of this driver's ResourceSlices. `python -m bench.scale [--nodes 10,100,500]`.

Per (layout, N): a fresh private control plane (hack/local-cluster.sh on free ports:
etcd, kube-apiserver, kube-controller-manager, kube-scheduler, the local cluster's DRA
gates), a second kube-scheduler with its client rate limit lifted
(bench/scale_scheduler.py), N fake Ready Nodes (no kubelets: pods are bound, never
run), their slices built by the driver's own slice builder (bench/scale_objects.py)
and created through the API. Then the two schedulers take turns, one repetition each:
pre-created claims, one pod per claim created in a burst, time to scheduled per pod,
pods and claims deleted before the next burst. Results:
bench/results/scale-<date>.json; `python -m bench.scale --report FILE` prints the
table, with `--doc docs/benchmarks.md` it rewrites that document's scale section.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import scale_cluster as sc
from bench import scale_objects as obj
from bench import scale_report
from bench.cluster import Api, BenchError, LocalCluster
from bench.scale_scheduler import (
    DEFAULT_SCHEDULER,
    UNTHROTTLED_SCHEDULER,
    VARIANTS,
    SchedulerMetrics,
    SchedulerVariant,
    UnthrottledScheduler,
    cluster_scheduler_metrics,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEFAULT_NODES = (10, 100, 500)
DEFAULT_POD_CAP = 200
WARMUP_NAMESPACE = "scale-warmup"
SETTLE_S = 3.0  # after the warm-up pod: the scheduler's slice informer catches up


def load_average() -> dict[str, float]:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return {"1m": float(one), "5m": float(five), "15m": float(fifteen)}


def kubernetes_version() -> str:
    out = subprocess.run(
        [str(LocalCluster.bin_dir() / "kube-scheduler"), "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().removeprefix("Kubernetes ")


def _node_of(api: Api, pod_path: str) -> str | None:
    node = api.get(pod_path)["spec"].get("nodeName")
    return str(node) if node else None


def _warm_up(api: Api, layout: obj.Layout) -> None:
    """One pod per scheduler scheduled end to end before anything is timed."""
    sc.ensure_namespace(api, WARMUP_NAMESPACE)
    base = f"/api/v1/namespaces/{WARMUP_NAMESPACE}"
    claims = f"/apis/resource.k8s.io/v1/namespaces/{WARMUP_NAMESPACE}/resourceclaims"
    for variant in VARIANTS:
        name = f"warmup-{variant.label}"
        api.post(claims, obj.claim_document(layout, name))
        api.post(f"{base}/pods", obj.pod_document(name, name, variant.name))
        sc.wait_for(
            functools.partial(_node_of, api, f"{base}/pods/{name}"),
            120,
            f"warm-up pod {name} bound",
        )
    time.sleep(SETTLE_S)


def _repetition(
    api: Api,
    metrics: SchedulerMetrics,
    variant: SchedulerVariant,
    layout: obj.Layout,
    pods: int,
    rep: int,
) -> dict[str, Any]:
    names = [
        (f"{variant.label}-{rep}-{i:04d}", f"{variant.label}-{rep}-{i:04d}") for i in range(pods)
    ]
    sc.create_claims(api, layout, [claim for _, claim in names])
    watch = sc.PodWatch(api, expected=pods)
    watch.start()
    before = metrics.totals()
    created = sc.create_pods(api, names, variant.name)
    watch.wait(timeout=60 + pods)
    after = metrics.totals()
    bound = [name for name in created if name in watch.scheduled_at]
    latency = [(watch.scheduled_at[n] - created[n]) * 1000 for n in bound]
    first = min(created.values())
    rate = (
        scale_report.throughput([created[n] for n in bound], [watch.scheduled_at[n] for n in bound])
        if bound
        else 0.0
    )
    if len(bound) == pods:
        sc.check_allocations(api, pods)
    result = {
        "pods": pods,
        "unscheduled": pods - len(bound),
        "ever_unschedulable": len(watch.unschedulable),
        "pods_per_s": rate,
        "nodes_used": len(set(watch.node_of.values())),
        "latency_ms": [round(ms, 2) for ms in latency],
        # Seconds after the first POST: each pod's creation and scheduling (pod order).
        "created_s": [round(created[n] - first, 4) for n in bound],
        "scheduled_s": [round(watch.scheduled_at[n] - first, 4) for n in bound],
        "scheduler": {k: after[k] - before[k] for k in after},
        "load": load_average(),
    }
    sc.delete_pods_and_claims(api)
    print(
        f"  {layout.name} {variant.label} rep {rep + 1}: {rate:.1f} pods/s, "
        f"{result['unscheduled']} unscheduled",
        file=sys.stderr,
    )
    return result


def _start_cluster(attempts: int = 3) -> LocalCluster:
    """A fresh control plane; a start that fails (on a busy machine a free port can be
    taken before the component binds it) is retried."""
    for attempt in range(1, attempts):
        try:
            return LocalCluster.start()
        except BenchError as err:
            print(f"  control plane start {attempt} failed, retrying: {err}"[:300], file=sys.stderr)
    return LocalCluster.start()


def run_point(layout: obj.Layout, nodes: int, pods: int, repetitions: int) -> list[dict[str, Any]]:
    """One point per scheduler; they take turns, one repetition each (A B A B ...)."""
    cluster = _start_cluster()
    unthrottled: UnthrottledScheduler | None = None
    try:
        if cluster.run_dir is None:
            raise BenchError("the benchmark cluster has no run directory")
        api = Api(cluster.kubeconfig)
        unthrottled = UnthrottledScheduler(cluster, cluster.run_dir)
        metrics = {
            DEFAULT_SCHEDULER: cluster_scheduler_metrics(cluster, cluster.run_dir),
            UNTHROTTLED_SCHEDULER: unthrottled.metrics,
        }
        for device_class in obj.device_classes():
            api.post("/apis/resource.k8s.io/v1/deviceclasses", device_class)
        sc.ensure_namespace(api, obj.NAMESPACE)
        names = [obj.node_name(i) for i in range(nodes)]
        uids = sc.create_nodes(api, names)
        published = sc.publish_slices(api, layout, names, uids)
        _warm_up(api, layout)
        reps: dict[str, list[dict[str, Any]]] = {v.label: [] for v in VARIANTS}
        for rep in range(repetitions):
            for v in VARIANTS:
                reps[v.label].append(_repetition(api, metrics[v.name], v, layout, pods, rep))
        return [
            {
                "layout": layout.name,
                "nodes": nodes,
                "scheduler": v.label,
                "scheduler_qps": v.qps,
                "slices": published.slices,
                "devices": published.devices,
                "slice_bytes": published.slice_bytes,
                "publish_s": round(published.publish_s, 3),
                "repetitions": reps[v.label],
            }
            for v in VARIANTS
        ]
    finally:
        if unthrottled is not None:
            unthrottled.stop()
        cluster.stop()


def run(args: argparse.Namespace) -> int:
    layouts = [obj.LAYOUTS[name] for name in args.layouts]
    started = dt.datetime.now(dt.UTC)
    clock = time.monotonic()
    results: dict[str, Any] = {
        "benchmark": "scheduler-scale",
        "started": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "kubernetes": kubernetes_version(),
        "repetitions": args.repetitions,
        "pod_cap": args.pod_cap,
        "gpus_per_node": obj.GPUS_PER_NODE,
        "gpu_model": obj.GPU_MODEL,
        "layouts": {layout.name: layout.description for layout in layouts},
        "timing": "local monotonic clock: before the pod's POST -> pod watch event with "
        "spec.nodeName set",
        "load": {"start": load_average()},
        "points": [],
    }
    for nodes in args.nodes:
        pods = obj.pod_count(nodes, args.pod_cap)
        for layout in layouts:
            print(f"{layout.name}: {nodes} nodes, {pods} pods", file=sys.stderr)
            results["points"] += run_point(layout, nodes, pods, args.repetitions)
    results["load"]["end"] = load_average()
    results["duration_s"] = round(time.monotonic() - clock, 1)
    out = args.out or RESULTS / f"scale-{started:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {out}", file=sys.stderr)
    sys.stdout.write(scale_report.table(results))
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"--nodes: not a comma-separated list of integers: {text!r}"
        ) from err
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--nodes: every count must be >= 1, got {text!r}")
    return values


def _layout_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in obj.LAYOUTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--layouts: unknown {', '.join(unknown)} (known: {', '.join(obj.LAYOUTS)})"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument(
        "--nodes", type=_int_list, default=list(DEFAULT_NODES), help="node counts, e.g. 10,100,500"
    )
    parser.add_argument(
        "--layouts",
        type=_layout_list,
        default=list(obj.DEFAULT_LAYOUTS),
        help=f"comma-separated, of {','.join(obj.LAYOUTS)} "
        f"(default {','.join(obj.DEFAULT_LAYOUTS)})",
    )
    parser.add_argument(
        "--repetitions", type=int, default=3, help="timed bursts per point (default 3)"
    )
    parser.add_argument(
        "--pod-cap", type=int, default=DEFAULT_POD_CAP, help="most pods per burst (default 200)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results file (default bench/results/scale-<date>.json)",
    )
    parser.add_argument(
        "--report", type=Path, metavar="RESULTS", help="print the table of a results file"
    )
    parser.add_argument(
        "--doc", type=Path, help="with --report: rewrite this document's scale section"
    )
    parser.add_argument(
        "--section",
        default="",
        help="with --report: the section's name (markers <!-- scale:NAME:begin/end -->; "
        "default: the main one)",
    )
    args = parser.parse_args(argv)
    if args.report:
        results = json.loads(args.report.read_text())
        if args.doc:
            doc = scale_report.replace_section(args.doc.read_text(), results, args.section)
            args.doc.write_text(doc)
        else:
            sys.stdout.write(scale_report.section(results, args.section) + "\n")
        return 0
    if args.repetitions < 1:
        parser.error("--repetitions must be >= 1")
    try:
        return run(args)
    except BenchError as err:
        print(f"bench.scale: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
