"""bench.run never overwrites a committed results file of the same day."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from bench.run import new_results_path

STARTED = dt.datetime(2026, 11, 26, 1, 2, 3, tzinfo=dt.UTC)


def test_the_first_run_of_a_day_is_named_by_its_date(tmp_path: Path) -> None:
    assert new_results_path(tmp_path / "results", STARTED) == tmp_path / "results/2026-11-26.json"
    assert (tmp_path / "results").is_dir()


def test_a_later_run_of_the_same_day_gets_a_suffix(tmp_path: Path) -> None:
    (tmp_path / "2026-11-26.json").write_text("{}")
    assert new_results_path(tmp_path, STARTED) == tmp_path / "2026-11-26-2.json"
    (tmp_path / "2026-11-26-2.json").write_text("{}")
    assert new_results_path(tmp_path, STARTED) == tmp_path / "2026-11-26-3.json"
    assert (tmp_path / "2026-11-26.json").read_text() == "{}"


def test_a_prefix_names_another_benchmark_s_results_apart(tmp_path: Path) -> None:
    (tmp_path / "2026-11-26.json").write_text("{}")
    assert new_results_path(tmp_path, STARTED, "allocator-") == (
        tmp_path / "allocator-2026-11-26.json"
    )
