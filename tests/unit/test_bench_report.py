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


def _with_nvidia() -> dict[str, Any]:
    results = _results()
    results["runs"].insert(2, _run("nvidia", 1, [0.020, 0.026], 1.5))
    results["runs"][2]["results"]["skipped"] = {"batch": "8 devices published, not 64"}
    build = {"package": "sigs.k8s.io/dra-driver-nvidia-gpu/cmd/gpu-kubelet-plugin", "go": "go1"}
    results["nvidia"] = {
        "plugin": {**build, "vcs_revision": "95932046683719c4", "vcs_modified": False},
        "nvml": {
            "package": "github.com/NVIDIA/k8s-test-infra/pkg/gpu/mocknvml/bridge",
            "vcs_revision": "3b2b865d91b1844b",
            "vcs_modified": True,
        },
        "flags": ["--kube-api-qps=1000", "--kube-api-burst=1000"],
        "skipped": {"xid": "this driver only"},
    }
    return results


def test_nvidia_gets_a_column_and_a_ratio_when_it_ran() -> None:
    text = tables(_with_nvidia())
    head = next(x for x in text.splitlines() if x.startswith("| scenario |"))
    assert head.endswith("| NVIDIA's plugin, QPS 1000 | ratio p50 / p99 |")
    line = next(x for x in text.splitlines() if x.startswith("| prepare, 1 claim |"))
    assert "2: 23 / 25.9 / 26 ms | 0.57x" in line  # p50 13 / 23


def test_the_header_names_nvidias_commits_and_what_it_did_not_run() -> None:
    text = markdown(_with_nvidia())
    assert "NVIDIA's plugin: `sigs.k8s.io/dra-driver-nvidia-gpu/cmd/gpu-kubelet-plugin`" in text
    assert "at 959320466837 (go1), --kube-api-qps=1000 --kube-api-burst=1000, over" in text
    assert "mocknvml/bridge` at 3b2b865d91b1 + local changes" in text
    assert "xid (this driver only); batch #1 (8 devices published, not 64)" in text


def test_a_run_that_could_not_start_nvidia_says_why() -> None:
    results = _results()
    results["nvidia"] = {"note": "not available (give --nvidia-plugin PATH)"}
    assert "NVIDIA's plugin: not available (give --nvidia-plugin PATH)." in markdown(results)


def test_results_from_before_nvidia_render_without_it() -> None:
    results = _results()
    text = markdown(results)
    assert "NVIDIA" not in text
    head = next(x for x in text.splitlines() if x.startswith("| scenario |"))
    assert head == "| scenario | this driver | reference, QPS 1000 | ratio p50 / p99 |"
