"""Figures and tables of the scheduler-scale benchmark (pure): results JSON -> markdown.

A point is one (layout, nodes) pair; its repetitions' pod latencies are pooled.
Percentiles interpolate linearly between the closest ranks (as bench/report does).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BEGIN = "<!-- scale:begin -->"
END = "<!-- scale:end -->"
LAYOUT_ORDER = (
    "mig",
    "mig3",
    "mig3-all-counters",
    "mig3-gpu-slices",
    "mig3-set-slices",
    "mig3-few-attributes",
    "whole",
    "partitions4",
)
SCHEDULER_ORDER = ("default", "unthrottled")


class ReportError(ValueError):
    pass


def percentile(samples: Sequence[float], p: float) -> float:
    if not samples:
        raise ReportError("percentile of no samples")
    if not 0 <= p <= 100:
        raise ReportError(f"percentile {p} is not within 0..100")
    if len(samples) == 1:
        return float(samples[0])
    ordered = sorted(samples)
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def throughput(created_at: Sequence[float], scheduled_at: Sequence[float]) -> float:
    """Pods per second from the first pod's creation to the last pod's scheduling."""
    if not created_at or len(created_at) != len(scheduled_at):
        raise ReportError("throughput needs one creation and one scheduling time per pod")
    span = max(scheduled_at) - min(created_at)
    if span <= 0:
        raise ReportError(f"non-positive span {span} s between first creation and last bind")
    return len(scheduled_at) / span


@dataclass(frozen=True)
class PointSummary:
    layout: str
    nodes: int
    scheduler: str  # "default" (as shipped) or "unthrottled" (client limit lifted)
    slices: int
    devices: int
    slice_mib: float
    publish_s: float
    pods: int  # pooled over repetitions
    repetitions: int
    pods_per_s: tuple[float, ...]  # one per repetition
    p50_ms: float
    p99_ms: float
    max_ms: float
    filter_ms: float | None  # scheduler's mean Filter phase per scheduling cycle
    dra_node_ms: float | None  # scheduler's mean DRA Filter on one node (sampled)
    unscheduled: int


def _field(point: Mapping[str, Any], key: str) -> Any:
    if key not in point:
        where = f"{point.get('layout', '?')}/{point.get('nodes', '?')}"
        raise ReportError(f"point {where}: field {key!r} is missing")
    return point[key]


def summarise(point: Mapping[str, Any]) -> PointSummary:
    reps = _field(point, "repetitions")
    if not reps:
        raise ReportError(f"point {point.get('layout')}/{point.get('nodes')}: no repetitions")
    latencies = [ms for rep in reps for ms in _field(rep, "latency_ms")]
    if not latencies:
        raise ReportError(f"point {point.get('layout')}/{point.get('nodes')}: no pod scheduled")
    metrics = [rep.get("scheduler") or {} for rep in reps]
    return PointSummary(
        layout=_field(point, "layout"),
        nodes=_field(point, "nodes"),
        scheduler=_field(point, "scheduler"),
        slices=_field(point, "slices"),
        devices=_field(point, "devices"),
        slice_mib=_field(point, "slice_bytes") / (1 << 20),
        publish_s=_field(point, "publish_s"),
        pods=len(latencies),
        repetitions=len(reps),
        pods_per_s=tuple(_field(rep, "pods_per_s") for rep in reps),
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        max_ms=max(latencies),
        filter_ms=mean_ms(metrics, "filter"),
        dra_node_ms=mean_ms(metrics, "dra_filter_node"),
        unscheduled=sum(_field(rep, "unscheduled") for rep in reps),
    )


def mean_ms(metrics: Sequence[Mapping[str, float]], name: str) -> float | None:
    """Mean of a scheduler histogram over the repetitions (`<name>_seconds` / `_count`)."""
    count = sum(m.get(f"{name}_count", 0) for m in metrics)
    seconds = sum(m.get(f"{name}_seconds", 0.0) for m in metrics)
    return seconds / count * 1000 if count else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _rank(value: str, order: Sequence[str]) -> int:
    return order.index(value) if value in order else len(order)


def _order(s: PointSummary) -> tuple[int, int, int]:
    return _rank(s.scheduler, SCHEDULER_ORDER), s.nodes, _rank(s.layout, LAYOUT_ORDER)


def _rate(values: Sequence[float]) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.1f}"
    return f"{mid:.1f} ({min(values):.1f}-{max(values):.1f})"


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else "-"


def table(results: Mapping[str, Any]) -> str:
    """The markdown table of every point, with each layout's p50 relative to `whole`."""
    summaries = sorted((summarise(p) for p in _field(results, "points")), key=_order)
    whole_p50 = {(s.scheduler, s.nodes): s.p50_ms for s in summaries if s.layout == "whole"}
    lines = [
        "| scheduler | layout | nodes | slices | devices | slice MiB | publish s | pods (n) "
        "| pods/s median (min-max) | p50 ms | p99 ms | max ms | p50 vs whole "
        "| Filter ms/pod | DRA filter ms/node | unscheduled |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        vs_whole = _ratio(s.p50_ms, whole_p50.get((s.scheduler, s.nodes)))
        lines.append(
            f"| {s.scheduler} | {s.layout} | {s.nodes} | {s.slices} | {s.devices} "
            f"| {s.slice_mib:.1f} | {s.publish_s:.1f} | {s.pods} | {_rate(s.pods_per_s)} "
            f"| {s.p50_ms:.0f} | {s.p99_ms:.0f} | {s.max_ms:.0f} | {vs_whole} "
            f"| {_ms(s.filter_ms)} | {_ms(s.dra_node_ms)} | {s.unscheduled} |"
        )
    return "\n".join(lines) + "\n"


def header(results: Mapping[str, Any]) -> str:
    load = _field(results, "load")
    start, end = load["start"], load["end"]
    return (
        f"Run {_field(results, 'started')} ({results.get('duration_s', 0):.0f} s), "
        f"Kubernetes {results.get('kubernetes', '?')}, "
        f"{results.get('repetitions', '?')} repetition(s) per point, "
        f"load average (1/5/15 min) {start['1m']}/{start['5m']}/{start['15m']} at start, "
        f"{end['1m']}/{end['5m']}/{end['15m']} at end.\n"
    )


def markers(name: str = "") -> tuple[str, str]:
    """The begin and end markers of the section `name` ("": the main one)."""
    if not name:
        return BEGIN, END
    return f"<!-- scale:{name}:begin -->", f"<!-- scale:{name}:end -->"


def section(results: Mapping[str, Any], name: str = "") -> str:
    begin, end = markers(name)
    return f"{begin}\n{header(results)}\n{table(results)}{end}"


def replace_section(doc: str, results: Mapping[str, Any], name: str = "") -> str:
    """`doc` with its section `name` generated anew from `results`."""
    begin, end = markers(name)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(doc):
        raise ReportError(f"the document has no {begin} … {end} markers")
    return pattern.sub(lambda _: section(results, name), doc, count=1)
