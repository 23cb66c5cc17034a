"""The table `gpu-dra health` prints: one line per failed GPU by default (its taints,
on how many of its devices), every published device taint with `--devices`."""

from __future__ import annotations

from typing import Any

from driver.cli.health.gpu_taints import taints_text
from driver.cli.output import format_table
from driver.devices.formatting import taint_text

HEADERS = ("SOURCE", "DEVICE", "TAINT", "SINCE", "REASON")


def render_table(report: dict[str, Any], *, devices: bool = False) -> str:
    rows: list[tuple[str, ...]] = []
    for line in report["store"]["failures"]:
        device = line["device"] or line["gpuUUID"]
        if line["scope"] == "instance":
            start, size = line["placement"]
            gi = line["gpuInstanceId"]
            device += f" (GPU instance {gi if gi is not None else '?'}, slices {start}+{size})"
        rows.append(("store", device, taint_text(line), line["since"], line["reason"]))
    for action in report["recovery"]["actions"]:
        device = action["device"] or action["gpuUUID"]
        rows.append(("plugin", device, taint_text(action), action["since"], action["reason"]))
    slices = report["slices"]
    if devices:
        for taint in slices["taints"]:
            rows.append(
                (
                    f"slice {taint['slice']}",
                    taint["device"],
                    taint_text(taint),
                    taint["timeAdded"] or "",
                    taint["reason"] or "(no failure recorded)",
                )
            )
    else:
        for gpu in slices["gpus"]:
            rows.append(
                (
                    "slices",
                    f"{gpu['gpu']} ({gpu['taintedDevices']} of {gpu['devices']} devices)",
                    taints_text(gpu),
                    gpu["since"] or "",
                    "; ".join(gpu["reasons"]) or "(no failure recorded)",
                )
            )
    lines: list[str] = []
    if rows:
        lines += [format_table(HEADERS, rows)]
    lines += _summary(report, devices=devices)
    return "\n".join(lines) + "\n"


def _summary(report: dict[str, Any], *, devices: bool) -> list[str]:
    store, slices, plugin = report["store"], report["slices"], report["plugin"]
    lines: list[str] = []
    if store["readable"]:
        count = len(store["failures"])
        lines.append(f"store: {count} recorded failure(s) in {store['path']}")
    else:
        lines.append(f"store: unknown: {store['problem']}")
    recovery = report["recovery"]
    if recovery["read"]:
        lines.append(
            f"recovery: {len(recovery['actions'])} NVML recovery action(s) that taint GPUs "
            "(the running plugin's)"
        )
    else:
        lines.append(f"recovery: unknown: {recovery['problem']}")
    if slices["read"]:
        listed = "" if devices or not slices["taints"] else " (--devices lists them)"
        lines.append(
            f"slices: {len(slices['gpus'])} tainted GPU(s) on node {report['node']} "
            f"({slices['source']}): {len(slices['taints'])} device taint(s){listed}"
        )
    else:
        lines.append(f"slices: not read: {slices['problem']}")
    if report.get("names"):
        lines.append(f"names: {report['names']}")
    if plugin["running"]:
        accepts = "accepts" if plugin["acceptsClear"] else "does NOT accept"
        lines.append(f"plugin: running (pid {plugin['pid']}), {accepts} `gpu-dra health clear`")
    else:
        lines.append(f"plugin: not found: {plugin['problem']}")
    lines += [f"note: {note}" for note in report["notes"]]
    return lines
