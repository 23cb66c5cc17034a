"""`gpu-dra health --all-nodes`: every node's tainted GPUs, from the ResourceSlices of
this driver in the API server (what the scheduler sees), one line per GPU sorted by
node: its taints (`key=value:effect`) and since when (the taints' `timeAdded`).

Needs no Prometheus and no plugin: Node Events expire after an hour, the slices' taints
stay as long as the plugin publishes them. Only each pool's newest generation counts.

    gpu-dra health --all-nodes
    gpu-dra health --all-nodes -o json
    gpu-dra health --all-nodes --fail-on-unhealthy   # exit 1 while a GPU is unhealthy
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from driver.cli.health.gpu_taints import GpuTaints, name_order, taints_by_gpu, taints_text
from driver.cli.output import format_table, print_report
from driver.cli.published import devices_of, list_slices

HEADERS = ("NODE", "GPU", "DEVICES", "TAINTS", "SINCE")


@dataclass(frozen=True)
class NodeGpus:
    node: str
    gpus: int  # whole GPUs published
    tainted: list[GpuTaints]


def nodes_of(slices: Sequence[dict[str, Any]]) -> list[NodeGpus]:
    """Slices grouped by node (their pool's newest generation), in node order."""
    pools: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for item in slices:
        spec = item.get("spec") or {}
        node = str(spec.get("nodeName") or (spec.get("pool") or {}).get("name") or "")
        pools.setdefault((node, str((spec.get("pool") or {}).get("name"))), []).append(item)
    by_node: dict[str, NodeGpus] = {}
    for (node, _), members in sorted(pools.items()):
        devices = devices_of(members)
        known = by_node.get(node, NodeGpus(node, 0, []))
        by_node[node] = NodeGpus(
            node,
            known.gpus + len({d.gpu_uuid for d in devices}),
            known.tainted + taints_by_gpu(devices),
        )
    return [by_node[node] for node in sorted(by_node)]


def build_report(driver: str, source: str, nodes: Sequence[NodeGpus]) -> dict[str, Any]:
    gpus = [
        {"node": n.node, **g.to_json(driver)}
        for n in nodes
        for g in sorted(n.tainted, key=lambda g: name_order(g.gpu))
    ]
    return {
        "driver": driver,
        "source": source,
        "nodes": len(nodes),
        "gpus": sum(n.gpus for n in nodes),
        "unhealthyGPUs": sum(1 for g in gpus if g["unhealthy"]),
        "taintedGPUs": gpus,
    }


def render_table(report: dict[str, Any]) -> str:
    rows = [
        (
            line["node"],
            line["gpu"],
            f"{line['taintedDevices']}/{line['devices']}",
            taints_text(line),
            line["since"] or "",
        )
        for line in report["taintedGPUs"]
    ]
    lines = [format_table(HEADERS, rows)] if rows else []
    lines.append(
        f"{len(rows)} tainted GPU(s), {report['unhealthyGPUs']} unhealthy, of "
        f"{report['gpus']} GPU(s) on {report['nodes']} node(s) ({report['source']})"
    )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    listing = list_slices(
        f"spec.driver={args.driver_name}",
        args.kubeconfig,
        allow_insecure_http=args.allow_insecure_http,
    )
    if listing.problem is not None:
        print(f"gpu-dra health --all-nodes: {listing.problem}", file=err)
        return 1
    report = build_report(args.driver_name, listing.source, nodes_of(listing.items))
    print_report(report, args.output, out, render_table)
    return 1 if args.fail_on_unhealthy and report["unhealthyGPUs"] else 0
