"""`make venv` says what it does: numbered steps, pip's progress as counts against the
lock, a line while pip is silent (hack/pip_progress.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "pip_progress.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pip_progress", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pip_progress"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


PIP_TRANSCRIPT = """\
Collecting grpcio==1.85.1 (from -r requirements.lock (line 120))
  Downloading grpcio-1.85.1-cp311-cp311-manylinux_2_17_x86_64.whl.metadata (3.9 kB)
Requirement already satisfied: pip==25.3 in ./.venv/lib/python3.11/site-packages
Collecting pyyaml==6.0.3 (from -r requirements.lock (line 300))
Downloading grpcio-1.85.1-cp311-cp311-manylinux_2_17_x86_64.whl (6.2 MB)
Using cached PyYAML-6.0.3-cp311-cp311-manylinux_2_17_x86_64.whl (762 kB)
Installing collected packages: pyyaml, grpcio
Successfully installed grpcio-1.85.1 pyyaml-6.0.3
"""


def test_pip_lines_become_counts_against_the_lock_total() -> None:
    progress = load().PipProgress(total=3)
    events = [e for line in PIP_TRANSCRIPT.splitlines(True) if (e := progress.feed(line))]
    assert [text for _, text in events] == [
        "fetching: 1/3 packages resolved, 0 downloaded (last: grpcio==1.85.1)",
        "fetching: 2/3 packages resolved, 0 downloaded (last: pip==25.3)",
        "fetching: 3/3 packages resolved, 0 downloaded (last: pyyaml==6.0.3)",
        "fetching: 3/3 packages resolved, 1 downloaded "
        "(last: grpcio-1.85.1-cp311-cp311-manylinux_2_17_x86_64.whl, 6.2 MB)",
        "fetching: 3/3 packages resolved, 2 downloaded "
        "(last: PyYAML-6.0.3-cp311-cp311-manylinux_2_17_x86_64.whl, 762 kB)",
        "installing 2 packages: pip says nothing until it is done",
        "done: 2 packages installed",
    ]


def test_the_total_is_the_number_of_pinned_requirements(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text(
        "#\n# comment\n#\naiohttp==3.14.5 \\\n    --hash=sha256:00\n    # via x\n"
        "pip==25.3 \\\n    --hash=sha256:11\n"
    )
    assert load().locked_package_count(lock) == 2


def _fake_pip(body: str) -> list[str]:
    return [sys.executable, "-c", f"import sys, time\n{body}"]


def test_a_silent_install_still_prints_a_line_and_each_phase_once() -> None:
    module = load()
    said: list[str] = []
    status = module.run(
        _fake_pip(
            "print('Installing collected packages: a, b', flush=True)\n"
            "time.sleep(0.8)\n"
            "print('Successfully installed a-1 b-2', flush=True)\n"
        ),
        module.PipProgress(total=2),
        said.append,
        interval=0.1,
        quiet_after=0.3,
    )
    assert status == 0
    assert said[0] == "installing 2 packages: pip says nothing until it is done"
    assert any(line.startswith("still installing 2 packages: no output for") for line in said)
    assert said[-1] == "done: 2 packages installed"


def test_lines_are_rate_limited_but_a_phase_ends_with_its_last_count() -> None:
    module = load()
    said: list[str] = []
    status = module.run(
        _fake_pip(
            "for n in range(3): print(f'Collecting p{n}==1.0', flush=True)\n"
            "print('Installing collected packages: p0, p1, p2', flush=True)\n"
            "print('Successfully installed p0-1.0 p1-1.0 p2-1.0', flush=True)\n"
        ),
        module.PipProgress(total=3),
        said.append,
        interval=60,
    )
    assert status == 0
    assert said == [
        "fetching: 1/3 packages resolved, 0 downloaded (last: p0==1.0)",
        "fetching: 3/3 packages resolved, 0 downloaded (last: p2==1.0)",
        "installing 3 packages: pip says nothing until it is done",
        "done: 3 packages installed",
    ]


def test_a_failed_pip_keeps_its_exit_status_and_shows_its_last_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = load()
    status = module.run(
        _fake_pip("print('ERROR: No matching distribution found for x')\nsys.exit(3)\n"),
        module.PipProgress(total=None),
        lambda _line: None,
    )
    assert status == 3
    err = capsys.readouterr().err
    assert "pip failed (exit status 3)" in err
    assert "ERROR: No matching distribution found for x" in err


def test_real_pip_output_is_counted_against_the_lock() -> None:
    """pip itself, on this venv (installed from the lock, so nothing is fetched)."""
    lock = REPO / "requirements.lock"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--step",
            "3/4",
            "--lock",
            str(lock),
            "--",
            sys.executable,
            "-m",
            "pip",
            "install",
            "--progress-bar",
            "off",
            "--no-index",
            "--dry-run",
            "--require-hashes",
            "-r",
            str(lock),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    total = load().locked_package_count(lock)
    assert "[venv 3/4" in result.stdout
    assert f"fetching: {total}/{total} packages resolved" in result.stdout, result.stdout


def test_make_venv_runs_every_pip_step_through_the_progress_printer() -> None:
    """Before, every pip install of `make venv` ran with --quiet: minutes of silence."""
    dry_run = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", ".venv/.installed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.replace("\\\n", " ")
    pip_lines = [line for line in dry_run.splitlines() if "pip install" in line]
    assert len(pip_lines) == 3, dry_run
    steps = []
    for line in pip_lines:
        assert "hack/pip_progress.py --step" in line, line
        assert "--quiet" not in line, line
        steps.append(line.split("--step ", 1)[1].split()[0])
    assert steps == ["2/4", "3/4", "4/4"]
    assert "[venv 1/4]" in dry_run
