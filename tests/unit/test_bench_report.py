"""bench.report: pooled rows over repetitions, ratios, target verdicts, the doc region."""

from __future__ import annotations

from typing import Any

import pytest

from bench.report import BEGIN, END, markdown, pooled, replace_region, summary, tables
from bench.report import ROWS as REPORT_ROWS

PREPARE_1 = next(r for rows in REPORT_ROWS.values() for r in rows if r.path[0] == "prepare_1")
START_64 = next(r for rows in REPORT_ROWS.values() for r in rows if r.path[0] == "start_64gpu")


def _run(driver: str, repetition: int, prepare_s: list[float], registered: float) -> Any:
    return {
        "driver": driver,
        "repetition": repetition,
        "load_start": {"1m": 0.5},
        "load_end": {"1m": 0.6},
        "results": {
            "prepare_1": {"prepare": {"samples_s": prepare_s}},
            "start_64gpu": {"registered_s": registered},
        },
    }


def _results() -> dict[str, Any]:
    return {
        "started": "2026-11-23T15:00:00Z",
        "finished": "2026-11-23T15:10:00Z",
        "parameters": {
            "repetitions": 2,
            "iterations": 2,
            "mig_iterations": 1,
            "batch_rounds": 1,
            "throttled_batch_rounds": 1,
            "xid_injections": 1,
        },
        "load": {"start": {"1m": 0.1}, "end": {"1m": 0.2}},
        "reference": {"note": "test"},
        "runs": [
            _run("ours", 1, [0.010, 0.012], 0.4),
            _run("reference_unthrottled", 1, [0.008, 0.008], 0.05),
            _run("ours", 2, [0.014, 0.016], 0.6),
            _run("reference_unthrottled", 2, [0.008, 0.008], 0.05),
        ],
    }


def test_latency_rows_pool_every_sample_of_every_repetition() -> None:
    stats = pooled(_results(), "ours", PREPARE_1)
    assert stats is not None
    assert stats.n == 4
    assert stats.p50 == pytest.approx(13.0)
    assert stats.max == pytest.approx(16.0)


def test_value_rows_take_one_value_per_repetition() -> None:
    stats = pooled(_results(), "ours", START_64)
    assert stats is not None
    assert (stats.n, stats.p50, stats.max) == (2, pytest.approx(0.5), pytest.approx(0.6))


def test_table_shows_n_percentiles_and_ratio_against_the_reference() -> None:
    text = tables(_results())
    line = next(x for x in text.splitlines() if x.startswith("| prepare, 1 claim |"))
    assert "4: 13 / 15.9 / 16 ms" in line
    assert "1.62x" in line  # p50 13 / 8


def test_summary_names_missed_targets_and_by_how_much() -> None:
    text = summary(_results())
    assert "**prepare, 1 claim**" in text
    assert "missed by" in text
    # start -> registered p50 0.5 s: exactly on the bound
    assert "start → registered (64 GPUs)**: p50 0.5 s (n = 2); target ≤ 0.5 s: met" in text


def test_markdown_records_the_load_of_every_turn() -> None:
    text = markdown(_results())
    assert "0.1 at the start, 0.2 at the end" in text
    assert "per turn: 0.5, 0.5, 0.5, 0.5" in text


def test_replace_region_keeps_the_text_around_the_markers() -> None:
    doc = f"intro\n{BEGIN}\nold table\n{END}\noutro\n"
    out = replace_region(doc, "new table\n")
    assert out == f"intro\n{BEGIN}\nnew table\n{END}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        replace_region("no markers", "x")


def test_the_handler_time_is_one_value_per_repetition_of_this_driver() -> None:
    results = _results()
    for run, mean_ms in zip(results["runs"][::2], (4.0, 6.0), strict=True):
        run["results"]["prepare_1"]["handler_mean_ms"] = mean_ms
    row = next(r for rs in REPORT_ROWS.values() for r in rs if "handler_mean_ms" in r.path)
    stats = pooled(results, "ours", row)
    assert stats is not None and (stats.n, stats.p50, stats.max) == (2, 5.0, 6.0)
    line = next(x for x in tables(results).splitlines() if "inside the plugin's handler" in x)
    assert "2: 5 / 5.98 / 6 ms | - |" in line  # the reference has no such figure
