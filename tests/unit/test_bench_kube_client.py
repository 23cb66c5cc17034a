"""bench.kube_client_report: medians over every sample, the per-turn spread, the
differences from the first tree, and the doc region."""

from __future__ import annotations

from typing import Any

import pytest

from bench.kube_client_report import BEGIN, END, markdown, replace_region


def _turn(tree: str, round_: int, rss: float, prepare_ms: list[float]) -> dict[str, Any]:
    return {
        "tree": tree,
        "round": round_,
        "import_s": [0.4],
        "import_cpu_s": [0.38],
        "import_rss_mib": [rss - 8],
        "import_modules": [608],
        "registered_s": [0.5],
        "cpu_registered_s": [0.45],
        "rss_registered_mib": [rss],
        "rss_after_cycles_mib": [rss + 1],
        "prepare_s": [[ms / 1e3 for ms in prepare_ms]],
        "load_1m": 1.5,
    }


def _document() -> dict[str, Any]:
    return {
        "command": "python -m bench.kube_client --tree a=<a tree> --tree b=<b tree>",
        "started": "2026-12-06T09:00:00Z",
        "finished": "2026-12-06T09:03:00Z",
        "machine": "2 CPUs",
        "trees": {
            "a": {"commit": "24ca0739c9efe8af", "changed": [], "sha256": {"api.py": "ab" * 32}},
            "b": {"commit": "", "changed": []},
        },
        "turns": [
            _turn("a", 0, 60.0, [4.0, 5.0, 6.0]),
            _turn("b", 0, 75.0, [4.0, 4.0, 4.0]),
            _turn("b", 1, 76.0, [5.0, 5.0, 5.0]),
            _turn("a", 1, 62.0, [3.0, 3.0, 3.0]),
        ],
    }


def test_cells_are_pooled_medians_with_the_per_turn_spread_and_the_difference() -> None:
    text = markdown(_document())
    header = "| measure | a | b | b - a |"
    assert header in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    # a: 60 and 62 -> 61; b: 75 and 76 -> 75.5; b - a = +14.5 (+24 %)
    assert rows["| RSS when registered (MiB)"].endswith(
        "| 61 (60-62) | 75.5 (75-76) | +14.5 (+24%) |"
    )
    # pooled over both turns: a [4, 5, 6, 3, 3, 3] -> 3.5; b [4, 4, 4, 5, 5, 5] -> 4.5
    assert "| 3.5 (3-5) | 4.5 (4-5) | +1 (+29%) |" in rows["| prepare, 1 claim: p50 (ms)"]
    assert "`a`: 24ca0739c9ef, api.py abababababab; `b`: not a git checkout" in text
    assert "2 rounds" in text and "3 timed prepare/unprepare cycles" in text
    assert text.rstrip().endswith("--tree b=<b tree>`.")


def test_the_doc_region_is_replaced_and_nothing_else() -> None:
    doc = f"intro\n{BEGIN}\nold\n{END}\noutro\n"
    assert replace_region(doc, "new\n") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        replace_region("no markers", "new\n")
