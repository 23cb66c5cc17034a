"""hack/build-image.sh's cached Debian base is refreshed: a base from the moving suite
is rebuilt once older than GPU_DRA_BASE_MAX_AGE_DAYS (or with --refresh-base), a
snapshot base never by age, and `--base-status` says which (without root or network)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from test_chart_render import REPO

SCRIPT = REPO / "hack" / "build-image.sh"
DAY = 86400


def status(cache: Path, *args: str, **env: str) -> dict[str, str]:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--base-status", *args],
        env={
            **{k: v for k, v in os.environ.items() if k != "DEBIAN_SNAPSHOT"},
            "GPU_DRA_CACHE": str(cache),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines())


def cache_base(base: Path, age_days: float) -> None:
    """A base as build-image.sh leaves it, built `age_days` ago."""
    (base / "rootfs").mkdir(parents=True)
    (base / "debootstrap.log").write_text("I: Valid Release signature (key id 4D64FEC1)\n")
    (base / "built-at").write_text(f"{int(time.time() - age_days * DAY)}\n")
    (base / ".complete").touch()


def test_a_fresh_base_is_reused_and_a_stale_one_rebuilt(tmp_path: Path) -> None:
    first = status(tmp_path)
    assert first["built"] == "never"
    assert first["next build"].startswith("rebuilds it (no verified base cached")
    base = Path(first["base"])
    assert base.parent == tmp_path / "image"

    cache_base(base, age_days=3)
    fresh = status(tmp_path)
    assert fresh["built"].endswith("(3 days ago)")
    assert fresh["next build"] == "reuses it"
    assert status(tmp_path, "--refresh-base")["next build"] == "rebuilds it (--refresh-base)"
    assert status(tmp_path, GPU_DRA_BASE_MAX_AGE_DAYS="2")["next build"].startswith(
        "rebuilds it (older than GPU_DRA_BASE_MAX_AGE_DAYS=2 days"
    )

    (base / "built-at").write_text(f"{int(time.time() - 40 * DAY)}\n")
    stale = status(tmp_path)
    assert stale["built"].endswith("(40 days ago)")
    assert "older than GPU_DRA_BASE_MAX_AGE_DAYS=30 days" in stale["next build"]


def test_a_base_without_a_verified_signature_is_rebuilt(tmp_path: Path) -> None:
    base = Path(status(tmp_path)["base"])
    cache_base(base, age_days=1)
    (base / "debootstrap.log").write_text("I: Retrieving Release\n")
    assert status(tmp_path)["next build"].startswith("rebuilds it (no verified base cached")


def test_a_snapshot_base_is_its_own_and_never_expires(tmp_path: Path) -> None:
    snapshot = {"DEBIAN_SNAPSHOT": "20260801T000000Z"}
    moving_base = status(tmp_path)["base"]
    pinned = status(tmp_path, **snapshot)
    assert pinned["base"] != moving_base
    assert pinned["mirror"] == "https://snapshot.debian.org/archive/debian/20260801T000000Z"
    cache_base(Path(pinned["base"]), age_days=400)
    assert status(tmp_path, **snapshot)["next build"] == "reuses it"


@pytest.mark.parametrize("bad", ["thirty", "-1"])
def test_a_bad_max_age_is_refused_naming_it(tmp_path: Path, bad: str) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--base-status"],
        env={**os.environ, "GPU_DRA_CACHE": str(tmp_path), "GPU_DRA_BASE_MAX_AGE_DAYS": bad},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"build-image: GPU_DRA_BASE_MAX_AGE_DAYS must be a number of days, not '{bad}'"
    )
