"""The markdown tables of a `bench.http_floods` results file:

    python -m bench.http_report --in bench/results/FILE.json

One row per scenario, one column per server (tree or candidate, in the order they
ran). A cell is `answered/sent (p90 ms), peak RSS MiB`: the legitimate reviews (or, on
the plugin's port, /healthz probes) answered within their deadline during the flood,
summed over the rounds, the p90 of those answered (a range over the rounds), the
server's peak RSS (the highest of the rounds). A second table gives the webhook probes
during each flood and the reviews answered after it ended; then the baselines (each
server's median over its scenarios of the p50 without a flood) and the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Outcome = dict[str, Any]


def _span(values: Iterable[float | None], unit: str = "") -> str:
    present = sorted(v for v in values if v is not None)
    if not present:
        return "-"
    low, high = f"{present[0]:g}", f"{present[-1]:g}"
    return (low if low == high else f"{low}-{high}") + unit


def _ratio(outcomes: list[Outcome], answered: str, sent: str) -> str:
    if any(o.get(sent) is None for o in outcomes):
        return "-"
    return f"{sum(o[answered] for o in outcomes)}/{sum(o[sent] for o in outcomes)}"


def _main_cell(outcomes: list[Outcome]) -> str:
    p90 = _span((o["p90_ms"] for o in outcomes), " ms")
    rss = max(o["server_peak_rss_mib"] for o in outcomes)
    return f"{_ratio(outcomes, 'answered', 'sent')} ({p90}), {rss:g} MiB"


def _side_cell(outcomes: list[Outcome]) -> str:
    probes = _ratio(outcomes, "probes_answered", "probes_sent")
    if probes != "-":
        probes += f" ({_span((o.get('probe_p90_ms') for o in outcomes), ' ms')})"
    return f"{probes}; after: {_ratio(outcomes, 'after_answered', 'after_sent')}"


def _table(
    rows: list[str],
    columns: list[str],
    cells: dict[tuple[str, str], list[Outcome]],
    cell: Callable[[list[Outcome]], str],
    names: dict[str, str],
) -> list[str]:
    lines = ["| scenario | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        values = [cell(cells[row, c]) if (row, c) in cells else "-" for c in columns]
        lines.append(f"| {names[row]} | " + " | ".join(values) + " |")
    return lines


def _on_plugin(o: Outcome) -> bool:
    return o.get("flood") == "status-metrics" or o["scenario"].startswith("/healthz")


def _baselines(columns: list[str], outcomes: list[Outcome]) -> list[str]:
    def median(column: str, key: str, plugin: bool) -> str:
        values = [
            o[key]
            for o in outcomes
            if o["tree"] == column and o.get(key) is not None and _on_plugin(o) == plugin
        ]
        return f"{statistics.median(values):g}" if values else "-"

    def row(title: str, key: str, plugin: bool = False) -> str:
        return f"| {title} | " + " | ".join(median(c, key, plugin) for c in columns) + " |"

    return [
        "| baseline p50, no flood (ms) | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
        row("webhook review", "baseline_p50_ms"),
        row("webhook probe /readyz", "baseline_probe_p50_ms"),
        row("plugin port /healthz", "baseline_p50_ms", plugin=True),
    ]


def report(document: dict[str, Any]) -> str:
    outcomes: list[Outcome] = document["outcomes"]
    columns = list(dict.fromkeys(o["tree"] for o in outcomes))
    rows = list(dict.fromkeys(o.get("flood") or o["scenario"] for o in outcomes))
    names = {o.get("flood") or o["scenario"]: o["scenario"] for o in outcomes}
    names = {row: f"{name} (`{row}`)" if row != name else name for row, name in names.items()}
    cells: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        cells.setdefault((o.get("flood") or o["scenario"], o["tree"]), []).append(o)
    servers = {**document.get("trees", {}), **document.get("candidates", {})}
    lines = [
        "Legitimate requests answered in time during the flood: answered/sent (p90 of "
        "those answered), server peak RSS.",
        "",
        *_table(rows, columns, cells, _main_cell, names),
        "",
        "Webhook probes (/readyz, 1 s) answered during the flood (p90); reviews answered "
        "after the flood ended.",
        "",
        *_table(rows, columns, cells, _side_cell, names),
        "",
        *_baselines(columns, outcomes),
        "",
        "Servers: " + "; ".join(f"`{c}`: {servers.get(c, '?')}" for c in columns) + ".",
        f"Machine: {document.get('machine', '?')}; {document.get('seconds', '?')} s per "
        "flood and round.",
        "",
        f"Raw results produced by `{document.get('command', '?')}`.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http_report", description=__doc__)
    parser.add_argument("--in", dest="path", type=Path, required=True)
    args = parser.parse_args()
    print(report(json.loads(args.path.read_text())))


if __name__ == "__main__":
    main()
