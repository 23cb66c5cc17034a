"""The table of a `bench.kube_client` results file:

    python -m bench.kube_client_report --in bench/results/FILE.json [--doc FILE]

One row per measure, one column per tree (in the order they ran), then each later
tree's difference from the first. A cell is the median over every sample of all
turns, and in brackets the lowest and highest of the per-turn medians: the spread
between rounds. Prepare latency is pooled over every timed call (p50, p99). Each
tree is named by its commit where it is a git checkout and by the sha256 (first 12
digits) of its API client's modules. With `--doc`, the part of FILE between this
module's markers is replaced.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.scenarios import percentile

BEGIN = "<!-- bench.kube_client_report: begin (generated; do not edit) -->"
END = "<!-- bench.kube_client_report: end -->"

Turn = dict[str, Any]
Statistic = Callable[[list[float]], float]


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _p50(values: list[float]) -> float:
    return percentile(sorted(values), 50)


def _p99(values: list[float]) -> float:
    return percentile(sorted(values), 99)


def _prepare(turn: Turn) -> list[float]:
    return [s for start in turn["prepare_s"] for s in start]


# (row, unit, scale, samples of a turn, statistic)
ROWS: list[tuple[str, str, float, Callable[[Turn], list[float]], Statistic]] = [
    ("import driver.plugin.main: wall", "ms", 1e3, lambda t: t["import_s"], _median),
    ("import driver.plugin.main: CPU", "ms", 1e3, lambda t: t["import_cpu_s"], _median),
    ("modules loaded by the import", "", 1, lambda t: t["import_modules"], _median),
    ("RSS after the import", "MiB", 1, lambda t: t["import_rss_mib"], _median),
    ("start → registered: wall", "ms", 1e3, lambda t: t["registered_s"], _median),
    ("start → registered: the plugin's CPU", "ms", 1e3, lambda t: t["cpu_registered_s"], _median),
    ("RSS when registered", "MiB", 1, lambda t: t["rss_registered_mib"], _median),
    ("prepare, 1 claim: p50", "ms", 1e3, _prepare, _p50),
    ("prepare, 1 claim: p99", "ms", 1e3, _prepare, _p99),
    ("RSS after the prepare cycles", "MiB", 1, lambda t: t["rss_after_cycles_mib"], _median),
]


def _number(value: float) -> str:
    if abs(value) < 1:
        return f"{value:.2f}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def markdown(document: dict[str, Any]) -> str:
    turns: list[Turn] = document["turns"]
    trees = list(dict.fromkeys(t["tree"] for t in turns))
    rounds = len({t["round"] for t in turns})
    first = trees[0]
    header = ["measure", *trees, *(f"{tree} - {first}" for tree in trees[1:])]
    lines = [
        "| " + " | ".join(header) + " |",
        "|---" + "|---:" * (len(header) - 1) + "|",
    ]
    for name, unit, scale, samples, statistic in ROWS:
        pooled: dict[str, float] = {}
        cells = []
        for tree in trees:
            own = [t for t in turns if t["tree"] == tree]
            pooled[tree] = statistic([s for t in own for s in samples(t)]) * scale
            per_turn = sorted(statistic(samples(t)) * scale for t in own)
            spread = f"{_number(per_turn[0])}-{_number(per_turn[-1])}"
            cells.append(f"{_number(pooled[tree])} ({spread})")
        for tree in trees[1:]:
            delta = pooled[tree] - pooled[first]
            sign = "+" if delta >= 0 else "-"
            cells.append(f"{sign}{_number(abs(delta))} ({delta / pooled[first]:+.0%})")
        lines.append(f"| {name}{f' ({unit})' if unit else ''} | " + " | ".join(cells) + " |")
    first_turn = turns[0]
    starts = len(first_turn["registered_s"])
    cycles = len(first_turn["prepare_s"][0]) if first_turn["prepare_s"] else 0
    trees_text = "; ".join(
        f"`{label}`: {info['commit'][:12] or 'not a git checkout'}"
        + (f" + {len(info['changed'])} changed files" if info["changed"] else "")
        + "".join(f", {name} {digest[:12]}" for name, digest in info.get("sha256", {}).items())
        for label, info in document["trees"].items()
    )
    loads = ", ".join(f"{t['load_1m']:.2f}" for t in turns)
    return "\n".join(
        [
            f"Run {document['started']} to {document['finished']}: {rounds} rounds, the trees "
            f"taking turns (order reversed every other round); per turn "
            f"{len(first_turn['import_s'])} import probes and {starts} plugin starts of "
            f"{cycles} timed prepare/unprepare cycles each. Trees: {trees_text}. "
            f"Machine: {document['machine']}. Load average (1 min) at each turn: {loads}.",
            "",
            *lines,
            "",
            f"Raw results produced by `{document['command']}`.",
            "",
        ]
    )


def replace_region(text: str, generated: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"markers {BEGIN!r} and {END!r} not found")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{generated}{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kube_client_report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--in", dest="results", type=Path, required=True)
    parser.add_argument("--doc", type=Path, help="replace the generated part of this file")
    args = parser.parse_args(argv)
    generated = f"Generated from `{args.results}`.\n\n" + markdown(
        json.loads(args.results.read_text())
    )
    if args.doc is None:
        print(generated, end="")
        return 0
    args.doc.write_text(replace_region(args.doc.read_text(), generated))
    print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
