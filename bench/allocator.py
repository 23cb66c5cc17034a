"""kube-scheduler's DRA allocator, timed per node over this driver's slices:
`python -m bench.allocator [--layouts mig3,whole] [--nodes 100] [--rounds 40]
[--passes 4] [--out DIR]`.

What `make bench-scale` measures through a whole control plane (pods per second),
this isolates: the CPU time the scheduler's own allocator (`bench/allocator/`, Go,
`k8s.io/dynamic-resource-allocation` as its go.mod pins) spends per node to allocate
one claim, over the ResourceSlices this driver publishes for a layout of
`bench/scale_objects.py` (the same layouts and `mig3` variants, docs/mig.md "Slice
layout"). No API server, no other load in the process: differences of a few percent
between layouts show.

Each pass runs every layout once, the layouts taking turns; a run times `--rounds`
rounds over all `--nodes` nodes (a fresh allocator each round, as the scheduler makes
one per pod) and keeps the fastest round. The table gives, per layout, the median
over the passes of that fastest round's CPU time per node, and what one node's
allocation allocated (Go heap). Raw results go to `DIR/allocator-<date>.json`
(default bench/results/). The Go program is built on first use into
~/.cache/gpu-dra-driver/bin/allocator-<source hash>/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import scale_objects as obj
from bench.run import new_results_path

SOURCE = Path(__file__).resolve().parent / "allocator"
CACHE = Path.home() / ".cache" / "gpu-dra-driver" / "bin"
RESULTS = Path(__file__).resolve().parent / "results"


class AllocatorError(RuntimeError):
    pass


def binary() -> Path:
    """The allocator program, built from bench/allocator/ once per source version."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((SOURCE / name).read_bytes())
    target = CACHE / f"allocator-{digest.hexdigest()[:16]}" / "allocator"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {target} (Go modules from the proxy on first use; about a minute)")
    env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
    partial = target.with_suffix(".partial")
    done = subprocess.run(
        ["go", "build", "-trimpath", "-o", str(partial), "."], cwd=SOURCE, env=env
    )
    if done.returncode != 0:
        raise AllocatorError(f"go build in {SOURCE} failed (exit {done.returncode})")
    partial.rename(target)
    return target


def allocator_input(layout: obj.Layout, nodes: int) -> dict[str, Any]:
    """The allocator's input: the layout's slices on `nodes` nodes, the chart's
    DeviceClasses and one claim for one device (the API server's defaults spelled out:
    the allocator reads the objects as they are)."""
    fleet = layout.fleet()
    names = [obj.node_name(i) for i in range(nodes)]
    slices = [
        doc
        for i, name in enumerate(names)
        for doc in obj.node_slices(layout, name, f"uid-{i}", fleet)
    ]
    claim = obj.claim_document(layout, "c")
    for request in claim["spec"]["devices"]["requests"]:
        request["exactly"].update(allocationMode="ExactCount", count=1)
    return {
        "slices": slices,
        "classes": obj.device_classes(),
        "claim": claim,
        "nodes": names,
    }


def run_once(program: Path, input_file: Path, rounds: int) -> dict[str, Any]:
    done = subprocess.run(
        [str(program), f"-in={input_file}", f"-rounds={rounds}"], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise AllocatorError(f"{program.name} {input_file.name}: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def summary(layout: obj.Layout, data: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    nodes = len(data["nodes"])
    return {
        "layout": layout.name,
        "devicesPerNode": sum(len(s["spec"].get("devices") or []) for s in data["slices"]) // nodes,
        "slicesPerNode": len(data["slices"]) // nodes,
        "microsPerNode": statistics.median(r["allocateMicrosPerNodeFastest"] for r in runs),
        "kibPerNode": statistics.median(r["allocatedKiBPerNode"] for r in runs),
        "mallocsPerNode": statistics.median(r["mallocsPerNode"] for r in runs),
        "device": runs[0]["device"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layout | devices per node | slices per node | allocator µs per node | KiB per node "
        "| allocations per node | device chosen |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['layout']} | {r['devicesPerNode']} | {r['slicesPerNode']} | "
        f"{r['microsPerNode']:.0f} | {r['kibPerNode']:.0f} | {r['mallocsPerNode']:.0f} | "
        f"{r['device']} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.allocator", description=__doc__)
    p.add_argument("--layouts", default="mig,mig3,whole", help=f"of {','.join(obj.LAYOUTS)}")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=40, help="per run; the fastest counts")
    p.add_argument("--passes", type=int, default=4, help="runs per layout, taking turns")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory of the raw results")
    args = p.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in obj.LAYOUTS]
    if unknown or not names:
        p.error(
            f"--layouts: unknown {', '.join(unknown) or '(none)'} (known: {', '.join(obj.LAYOUTS)})"
        )
    if min(args.nodes, args.rounds, args.passes) < 1:
        p.error("--nodes, --rounds and --passes: at least 1")
    try:
        program = binary()
    except AllocatorError as err:
        print(err, file=sys.stderr)
        return 1
    started = dt.datetime.now(dt.UTC)
    layouts = [obj.LAYOUTS[n] for n in names]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="gpu-dra-allocator-") as work:
        inputs: dict[str, tuple[Path, dict[str, Any]]] = {}
        for layout in layouts:
            data = allocator_input(layout, args.nodes)
            path = Path(work) / f"{layout.name}.json"
            path.write_text(json.dumps(data))
            inputs[layout.name] = (path, data)
        for i in range(args.passes):
            for layout in layouts:
                print(f"pass {i + 1}/{args.passes}: {layout.name}", flush=True)
                try:
                    runs[layout.name].append(run_once(program, inputs[layout.name][0], args.rounds))
                except AllocatorError as err:
                    print(err, file=sys.stderr)
                    return 1
        rows = [summary(layout, inputs[layout.name][1], runs[layout.name]) for layout in layouts]
    results = {
        "command": " ".join(["python -m bench.allocator", *(argv or sys.argv[1:])]),
        "started": started.isoformat(timespec="seconds"),
        "parameters": {"nodes": args.nodes, "rounds": args.rounds, "passes": args.passes},
        "allocator": (SOURCE / "go.mod").read_text(),
        "layouts": {layout.name: layout.description for layout in layouts},
        "runs": runs,
        "summary": rows,
    }
    path = new_results_path(args.out, started, prefix="allocator-")
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(table(rows))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
