"""kube-scheduler's DRA allocator, timed per node over this driver's slices:
`python -m bench.allocator [--layouts mig3,whole] [--nodes 100] [--rounds 40]
[--passes 4] [--claim whole|PROFILE] [--pprof DIR] [--out DIR]`.

What `make bench-scale` measures through a whole control plane (pods per second),
this isolates: the CPU time the scheduler's own allocator (`bench/allocator/`, Go,
`k8s.io/dynamic-resource-allocation` as its go.mod pins) spends per node to allocate
one claim, over the ResourceSlices this driver publishes for a layout of
`bench/scale_objects.py` (the same layouts and `mig3` variants, docs/mig.md "Slice
layout"; `mig3-<variant>` for every variant of bench/scale_layouts.py). No API server,
no other load in the process: differences of a few percent between layouts show.

The claim asks for one device of the layout's kind (a 1g.10gb MIG device on MIG
layouts); `--claim 3g.40gb` asks MIG layouts for that profile instead, `--claim whole`
every layout for a whole GPU. `--pprof DIR` adds one run per layout after the timed
passes that writes `DIR/<layout>.cpu.pprof` (CPU of the timed rounds), and one that
writes `DIR/<layout>.allocs.pprof` (every allocation), for `go tool pprof -top`; the
program is `DIR/allocator`.

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
import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import scale_layouts
from bench import scale_objects as obj
from bench.run import new_results_path

SOURCE = Path(__file__).resolve().parent / "allocator"
CACHE = Path.home() / ".cache" / "gpu-dra-driver" / "bin"
RESULTS = Path(__file__).resolve().parent / "results"


_PROFILE = re.compile(r"^\d+g\.\d+gb(\+\w+)?$")


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


def layouts() -> dict[str, obj.Layout]:
    """The scale benchmark's layouts and `mig3-<variant>` for every slice layout."""
    mig3 = obj.LAYOUTS["mig3"]
    variants = {
        f"mig3-{v}": dataclasses.replace(
            mig3, name=f"mig3-{v}", reshape=v, description=f"mig3 with its slices reshaped: {v}"
        )
        for v in scale_layouts.RESHAPES
    }
    return {**variants, **obj.LAYOUTS}


def claimed(layout: obj.Layout, claim: str) -> obj.Layout:
    """The layout with its claim asking for `claim`: "" (its own), "whole" (a whole
    GPU) or a MIG profile (MIG layouts only; others keep their own)."""
    if not claim:
        return layout
    if claim == "whole":
        return dataclasses.replace(layout, device_class=obj.WHOLE_CLASS, selector=None)
    if layout.device_class != obj.MIG_CLASS:
        return layout
    expression = f"device.attributes['{obj.DRIVER}'].profile == '{claim}'"
    return dataclasses.replace(layout, selector=expression)


def allocator_input(layout: obj.Layout, nodes: int, claim: str = "") -> dict[str, Any]:
    """The allocator's input: the layout's slices on `nodes` nodes, the chart's
    DeviceClasses and one claim for one device (the API server's defaults spelled out:
    the allocator reads the objects as they are); `claim` as `claimed` takes it."""
    layout = claimed(layout, claim)
    fleet = layout.fleet()
    names = [obj.node_name(i) for i in range(nodes)]
    slices = [
        doc
        for i, name in enumerate(names)
        for doc in obj.node_slices(layout, name, f"uid-{i}", fleet)
    ]
    document = obj.claim_document(layout, "c")
    for request in document["spec"]["devices"]["requests"]:
        request["exactly"].update(allocationMode="ExactCount", count=1)
    return {
        "slices": slices,
        "classes": obj.device_classes(),
        "claim": document,
        "nodes": names,
    }


def run_once(
    program: Path, input_file: Path, rounds: int, flags: Sequence[str] = ()
) -> dict[str, Any]:
    """One run of `rounds` rounds; `flags`: the program's further flags (profiles)."""
    command = [str(program), f"-in={input_file}", f"-rounds={rounds}", *flags]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise AllocatorError(f"{program.name} {input_file.name}: {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def profile(program: Path, out: Path, inputs: dict[str, Path], rounds: int) -> None:
    """One profiled run per layout into `out`, with the program pprof reads symbols from."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(program, out / "allocator")
    for name, input_file in inputs.items():
        print(f"profile: {name}", flush=True)
        # Apart: sampling every allocation slows allocating code, skewing the CPU profile.
        run_once(program, input_file, rounds, [f"-cpuprofile={out / f'{name}.cpu.pprof'}"])
        run_once(program, input_file, rounds, [f"-memprofile={out / f'{name}.allocs.pprof'}"])
    print(f"profiles: {out} (go tool pprof -top {out / 'allocator'} {out}/<layout>.cpu.pprof)")


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
    known = layouts()
    p.add_argument("--layouts", default="mig,mig3,whole", help=f"of {','.join(known)}")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=40, help="per run; the fastest counts")
    p.add_argument("--passes", type=int, default=4, help="runs per layout, taking turns")
    p.add_argument("--claim", default="", help="whole, or a MIG profile (3g.40gb) for MIG layouts")
    p.add_argument("--pprof", type=Path, help="directory for a profiled run's pprof files")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory of the raw results")
    args = p.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        p.error(f"--layouts: unknown {', '.join(unknown) or '(none)'} (known: {', '.join(known)})")
    if args.claim and args.claim != "whole" and not _PROFILE.match(args.claim):
        p.error(f"--claim: {args.claim!r} is neither whole nor a MIG profile like 3g.40gb")
    if min(args.nodes, args.rounds, args.passes) < 1:
        p.error("--nodes, --rounds and --passes: at least 1")
    try:
        program = binary()
    except AllocatorError as err:
        print(err, file=sys.stderr)
        return 1
    started = dt.datetime.now(dt.UTC)
    chosen = [known[n] for n in names]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="gpu-dra-allocator-") as work:
        inputs: dict[str, tuple[Path, dict[str, Any]]] = {}
        for layout in chosen:
            data = allocator_input(layout, args.nodes, args.claim)
            path = Path(work) / f"{layout.name}.json"
            path.write_text(json.dumps(data))
            inputs[layout.name] = (path, data)
        for i in range(args.passes):
            for layout in chosen:
                print(f"pass {i + 1}/{args.passes}: {layout.name}", flush=True)
                try:
                    runs[layout.name].append(run_once(program, inputs[layout.name][0], args.rounds))
                except AllocatorError as err:
                    print(err, file=sys.stderr)
                    return 1
        if args.pprof is not None:
            try:
                profile(program, args.pprof, {n: inputs[n][0] for n in names}, args.rounds)
            except AllocatorError as err:
                print(err, file=sys.stderr)
                return 1
        rows = [summary(layout, inputs[layout.name][1], runs[layout.name]) for layout in chosen]
    results = {
        "command": " ".join(["python -m bench.allocator", *(argv or sys.argv[1:])]),
        "started": started.isoformat(timespec="seconds"),
        "parameters": {
            "nodes": args.nodes,
            "rounds": args.rounds,
            "passes": args.passes,
            "claim": args.claim or "the layout's",
        },
        "allocator": (SOURCE / "go.mod").read_text(),
        "layouts": {layout.name: layout.description for layout in chosen},
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
