"""Tables and the summary of a results file: `python -m bench.report RESULTS [--doc FILE]`.

Every row pools the repetitions of one driver: the samples of a latency scenario, or one
value per repetition for a start-up time, a size or a count, and shows n, p50, p99 and
max. Ratios are this driver / reference (below 1 is better). With `--doc`, the part of
the file between the two `bench.report` markers is replaced; nothing in it is typed by
hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.scenarios import percentile

BEGIN = "<!-- bench.report: begin (generated; do not edit) -->"
END = "<!-- bench.report: end -->"
NAMES = {
    "ours": "this driver",
    "reference_unthrottled": "reference, QPS 1000",
    "reference": "reference as shipped",
    "nvidia": "NVIDIA's plugin, QPS 1000",
}


@dataclass(frozen=True)
class Row:
    label: str
    path: tuple[str, ...]
    unit: str  # "ms" for latency summaries (pooled samples); "s", "MiB" or "" for values
    scale: float = 1.0  # value -> unit
    value: bool = False  # one value per repetition even where the unit is "ms"


ROWS: dict[str, list[Row]] = {
    "Prepare and unprepare (64 `example` GPUs, like for like)": [
        Row("prepare, 1 claim", ("prepare_1", "prepare"), "ms"),
        Row(
            "prepare, 1 claim: inside the plugin's handler (mean per call)",
            ("prepare_1", "handler_mean_ms"),
            "ms",
            value=True,
        ),
        Row("unprepare, 1 claim", ("prepare_1", "unprepare"), "ms"),
        Row("prepare, 64-claim batch", ("prepare_64", "prepare"), "ms"),
        Row("unprepare, 64-claim batch", ("prepare_64", "unprepare"), "ms"),
    ],
    "This driver only (8 mock H100 with MIG)": [
        Row("MIG partition 1g.10gb: prepare (instance create)", ("mig_partition", "prepare"), "ms"),
        Row(
            "MIG partition 1g.10gb: unprepare (instance destroy)",
            ("mig_partition", "unprepare"),
            "ms",
        ),
        Row(
            "MIG partition: NVML calls per prepare + unprepare",
            ("mig_partition", "nvml_calls_per_cycle"),
            "",
        ),
        Row("whole GPU on a MIG GPU (7g.80gb): prepare", ("mig_whole_gpu", "prepare"), "ms"),
        Row("whole GPU on a MIG GPU (7g.80gb): unprepare", ("mig_whole_gpu", "unprepare"), "ms"),
        Row("repeated permanent-error prepare", ("permanent_repeat", "repeat"), "ms"),
        Row(
            "NVML calls of the prepare path during the repeats",
            ("permanent_repeat", "nvml_calls_during_repeats"),
            "",
        ),
        Row(
            "state file writes during the repeats",
            ("permanent_repeat", "state_writes_during_repeats"),
            "",
        ),
        Row("Xid → taint visible in the API", ("xid_to_taint", "taint_visible"), "ms"),
    ],
    "Start-up, slices and memory": [
        Row("64 GPUs: start → registered", ("start_64gpu", "registered_s"), "s"),
        Row("64 GPUs: start → published", ("start_64gpu", "published_s"), "s"),
        Row("64 GPUs: devices published", ("start_64gpu", "devices"), ""),
        Row("64 GPUs: slice writes at start", ("start_64gpu", "slice_writes"), ""),
        Row("64 GPUs: slice writes of a no-change resync", ("resync_64gpu", "slice_writes"), ""),
        Row("RSS after warm-up, 64 GPUs", ("rss_kib_64gpu",), "MiB", 1 / 1024),
        Row("8 GPUs: start → registered", ("start_8gpu", "registered_s"), "s"),
        Row("8 GPUs: start → published", ("start_8gpu", "published_s"), "s"),
        Row("8 GPUs: devices published", ("start_8gpu", "devices"), ""),
        Row("8 GPUs: slices", ("start_8gpu", "slices"), ""),
        Row("8 GPUs: slice writes at start", ("start_8gpu", "slice_writes"), ""),
        Row("8 GPUs: slice writes of a no-change resync", ("resync_8gpu", "slice_writes"), ""),
        Row("8 GPUs: restart, start → registered", ("restart_8gpu", "registered_s"), "s"),
        Row(
            "8 GPUs: restart, slice writes (slices in place)", ("restart_8gpu", "slice_writes"), ""
        ),
        Row("RSS after the scenarios, 8 GPUs", ("rss_kib_8gpu",), "MiB", 1 / 1024),
        Row("64 H100 with MIG: start → published", ("start_mig64", "published_s"), "s"),
        Row("64 H100 with MIG: devices published", ("start_mig64", "devices"), ""),
        Row("64 H100 with MIG: slices", ("start_mig64", "slices"), ""),
        Row("64 H100 with MIG: slice writes at start", ("start_mig64", "slice_writes"), ""),
        Row(
            "64 H100 with MIG: slice writes of a no-change resync",
            ("resync_mig64", "slice_writes"),
            "",
        ),
        Row("RSS, 64 H100 with MIG", ("rss_kib_mig64",), "MiB", 1 / 1024),
    ],
}


@dataclass(frozen=True)
class Stats:
    n: int
    p50: float
    p99: float
    max: float


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def pooled(results: dict[str, Any], driver: str, row: Row) -> Stats | None:
    """The row's figures over every repetition of `driver`, in the row's unit."""
    values: list[float] = []
    for run in results.get("runs", []):
        if run["driver"] != driver:
            continue
        found = _get(run["results"], row.path)
        if found is None:
            continue
        if row.unit == "ms" and not row.value:
            values += [s * 1000 for s in found["samples_s"]]
        else:
            values.append(float(found) * row.scale)
    if not values:
        return None
    ordered = sorted(values)
    return Stats(len(ordered), percentile(ordered, 50), percentile(ordered, 99), ordered[-1])


def _num(value: float) -> str:
    if value == int(value) and abs(value) >= 1:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def cell(stats: Stats | None, unit: str) -> str:
    if stats is None:
        return "-"
    unit = f" {unit}" if unit else ""
    return f"{stats.n}: {_num(stats.p50)} / {_num(stats.p99)} / {_num(stats.max)}{unit}"


def ratio(ours: Stats | None, ref: Stats | None) -> str:
    if ours is None or ref is None:
        return "-"
    parts = []
    for a, b in ((ours.p50, ref.p50), (ours.p99, ref.p99)):
        parts.append(("=" if a == 0 else "inf") if b == 0 else f"{a / b:.2f}x")
    return " / ".join(parts)


def drivers_of(results: dict[str, Any]) -> list[str]:
    seen = {run["driver"] for run in results.get("runs", [])}
    return [d for d in NAMES if d in seen]


def tables(results: dict[str, Any]) -> str:
    drivers = drivers_of(results)
    refs = [d for d in drivers if d != "ours"]
    head = ["scenario", "this driver"]
    for ref in refs:
        head += [NAMES[ref], "ratio p50 / p99"]
    lines: list[str] = []
    for title, rows in ROWS.items():
        body = []
        for row in rows:
            ours = pooled(results, "ours", row)
            if ours is None:
                continue
            cells = [row.label, cell(ours, row.unit)]
            for ref in refs:
                theirs = pooled(results, ref, row)
                cells += [cell(theirs, row.unit), ratio(ours, theirs)]
            body.append("| " + " | ".join(cells) + " |")
        if body:
            lines += [f"#### {title}", "", "| " + " | ".join(head) + " |"]
            lines += ["|---" + "|---:" * (len(head) - 1) + "|", *body, ""]
    floor = results.get("floor")
    if floor:
        lines += [
            "#### The disk's floor (the plugins' directory)",
            "",
            "| operation | n: p50 / p99 / max |",
            "|---|---:|",
        ]
        for label, key in (
            ("fsync of a small file", "fsync"),
            ("atomic write (temp, fsync, rename, directory fsync)", "atomic_write"),
        ):
            s = floor[key]
            lines.append(
                f"| {label} | {s['n']}: {s['p50_ms']} / {s['p99_ms']} / {s['max_ms']} ms |"
            )
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    label: str
    row: Row
    against: str | None  # a reference driver, or None for an absolute bound
    bound: float  # a ratio, or a value in the row's unit
    percentiles: tuple[str, ...] = ("p50", "p99")
    min_n: int = 0


def _row(path: tuple[str, ...]) -> Row:
    return next(r for rows in ROWS.values() for r in rows if r.path == path)


TARGETS = [
    Target("prepare, 1 claim", _row(("prepare_1", "prepare")), "reference_unthrottled", 1.0),
    Target("unprepare, 1 claim", _row(("prepare_1", "unprepare")), "reference_unthrottled", 1.0),
    Target(
        "prepare, 64-claim batch", _row(("prepare_64", "prepare")), "reference_unthrottled", 0.8
    ),
    Target(
        "RSS after warm-up (64 GPUs)",
        _row(("rss_kib_64gpu",)),
        "reference_unthrottled",
        1.2,
        ("p50",),
    ),
    Target(
        "start → registered (64 GPUs)", _row(("start_64gpu", "registered_s")), None, 0.5, ("p50",)
    ),
    Target(
        "start → registered (8 GPUs)", _row(("start_8gpu", "registered_s")), None, 0.5, ("p50",)
    ),
    Target(
        "Xid → taint visible",
        _row(("xid_to_taint", "taint_visible")),
        None,
        250.0,
        ("p99",),
        min_n=200,
    ),
]


def _verdict(value: float, bound: float) -> str:
    if value <= bound:
        return "met"
    return f"**missed by {(value / bound - 1) * 100:.0f} %**"


def summary(results: dict[str, Any]) -> str:
    lines = []
    for t in TARGETS:
        ours = pooled(results, "ours", t.row)
        if ours is None:
            continue
        unit = f" {t.row.unit}" if t.row.unit else ""
        if t.against is None:
            parts = [f"{p} {_num(getattr(ours, p))}{unit}" for p in t.percentiles]
            worst = max(getattr(ours, p) for p in t.percentiles)
            verdict = _verdict(worst, t.bound)
            if ours.n < t.min_n:
                verdict += f" (but n = {ours.n} < {t.min_n})"
            lines.append(
                f"- **{t.label}**: {', '.join(parts)} (n = {ours.n}); "
                f"target ≤ {_num(t.bound)}{unit}: {verdict}."
            )
            continue
        theirs = pooled(results, t.against, t.row)
        if theirs is None:
            lines.append(f"- **{t.label}**: no {NAMES[t.against]} in this run.")
            continue
        parts = []
        worst = 0.0
        for p in t.percentiles:
            a, b = getattr(ours, p), getattr(theirs, p)
            worst = max(worst, a / b)
            parts.append(f"{p} {_num(a)} vs {_num(b)}{unit} = {a / b:.2f}x")
        shipped = pooled(results, "reference", t.row)
        against_shipped = (
            f"; against the reference as shipped: {ratio(ours, shipped)}"
            if shipped is not None and t.percentiles == ("p50", "p99")
            else ""
        )
        lines.append(
            f"- **{t.label}** against the unthrottled reference: {'; '.join(parts)} "
            f"(n = {ours.n} / {theirs.n}); target ≤ {t.bound}x: {_verdict(worst, t.bound)}"
            f"{against_shipped}."
        )
    return "\n".join(lines)


def header(results: dict[str, Any]) -> str:
    p = results["parameters"]
    load = results["load"]
    ref = results.get("reference", {})
    if "version" in ref:
        ref_text = (
            f"`{ref.get('package', ref.get('module'))}` {ref['version']} ({ref.get('go')}), "
            f"as `go version -m` reads it from the binary {ref['built_by']} built"
        )
    else:
        ref_text = ref.get("note", "not available")
    order = ", ".join(f"{NAMES[r['driver']]} #{r['repetition']}" for r in results["runs"])
    nvidia = ["", nvidia_text(results)] if "nvidia" in results else []
    return "\n".join(
        [
            f"Run {results['started']} to {results.get('finished', '?')}: "
            f"{p['repetitions']} repetitions, drivers taking turns ({order}); per repetition "
            f"{p['iterations']} single-claim cycles, {p['batch_rounds']} batch rounds "
            f"({p['throttled_batch_rounds']} for the reference as shipped), "
            f"{p.get('mig_iterations', '-')} cycles per MIG device, "
            f"{p['xid_injections']} Xid injections. Load average (1 min) "
            f"{load['start']['1m']} at the start, {load.get('end', {}).get('1m', '?')} at the end; "
            f"per turn: {', '.join(str(r['load_start']['1m']) for r in results['runs'])}.",
            "",
            f"Reference: {ref_text}.",
            *nvidia,
            "",
            "Cells: n: p50 / p99 / max, pooled over the repetitions (latency rows: every "
            "call; other rows: one value per repetition). Ratios: this driver / reference.",
        ]
    )


def _commit(build: dict[str, Any]) -> str:
    revision = build.get("vcs_revision", "?")[:12]
    return f"{revision}{' + local changes' if build.get('vcs_modified') else ''}"


def nvidia_text(results: dict[str, Any]) -> str:
    """Which NVIDIA plugin and mock NVML ran, and what was skipped for them."""
    nvidia = results["nvidia"]
    if "plugin" not in nvidia:
        return f"NVIDIA's plugin: {nvidia.get('note', 'not available')}."
    plugin, nvml = nvidia["plugin"], nvidia["nvml"]
    text = (
        f"NVIDIA's plugin: `{plugin.get('package')}` at {_commit(plugin)} "
        f"({plugin.get('go')}), {' '.join(nvidia.get('flags', []))}, over the mock NVML "
        f"`{nvml.get('package')}` at {_commit(nvml)}. Ratios in its column: this driver / "
        "NVIDIA's plugin."
    )
    skipped = dict(nvidia.get("skipped", {}))
    for run in results["runs"]:
        if run["driver"] == "nvidia":
            for scenario, why in run["results"].get("skipped", {}).items():
                skipped[f"{scenario} #{run['repetition']}"] = why
    if skipped:
        text += " Not run for it: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + "."
    return text


def markdown(results: dict[str, Any]) -> str:
    return "\n\n".join([header(results), summary(results), tables(results)]).rstrip() + "\n"


def replace_region(text: str, generated: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"markers {BEGIN!r} and {END!r} not found")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{generated}{END}{after}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="bench/results/<date>.json")
    p.add_argument("--doc", type=Path, help="replace the generated part of this file")
    args = p.parse_args(argv)
    generated = markdown(json.loads(args.results.read_text()))
    generated = f"Generated from `{args.results}`.\n\n{generated}"
    if args.doc is None:
        print(generated, end="")
        return 0
    args.doc.write_text(replace_region(args.doc.read_text(), generated))
    print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
