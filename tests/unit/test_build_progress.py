"""Progress of the Go builds (hack/lib/go-progress.sh): counts with a total, and lines
that keep moving. Cold builds are never run here: a fake `go` stands in for them, and
`go list` runs for real on a tiny module."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GO_PROGRESS = REPO / "hack" / "lib" / "go-progress.sh"
FAST = {"GPU_DRA_PROGRESS_POLL": "0.05", "GPU_DRA_PROGRESS_EVERY": "0"}


def bash(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    prelude = (
        "set -euo pipefail\n"
        "progress() { printf '[test] %s\\n' \"$*\"; }\n"
        "die() { printf 'die: %s\\n' \"$*\" >&2; exit 1; }\n"
        f"source {GO_PROGRESS}\n"
    )
    return subprocess.run(
        ["bash", "-c", prelude + script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **FAST, **(env or {})},
        check=False,
    )


def test_status_counts_downloads_and_compiled_packages_against_the_total(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    log.write_text(
        "go: downloading k8s.io/api v0.37.1\n"
        "internal/abi\n"  # the standard library: not counted
        "k8s.io/apimachinery/pkg/util/sets\n"
        "# k8s.io/broken\n"
        "k8s.io/broken/x.go:1:2: undefined: y\n"  # an error line is no package
        "k8s.io/kubernetes/cmd/kubelet\n"
    )
    out = bash(f"go_log_status {log} 2411").stdout.strip()
    assert out == (
        "1 modules downloaded, 2 of at most 2411 packages compiled, "
        "last: k8s.io/kubernetes/cmd/kubelet"
    )
    without_total = bash(f"go_log_status {log}").stdout.strip()
    assert "2 packages compiled" in without_total and "at most" not in without_total


def test_a_build_in_progress_prints_counts_that_grow(tmp_path: Path) -> None:
    fake_build = "for p in a b c d; do echo example.com/m/$p; sleep 0.2; done"  # go build -v
    result = bash(
        f"run_with_progress --total 4 'demo build' {tmp_path / 'b.log'} bash -c '{fake_build}'"
    )
    assert result.returncode == 0, result.stderr
    counts = [int(n) for n in re.findall(r"demo build: (\d+) of at most 4", result.stdout)]
    assert len(counts) >= 2, result.stdout
    assert counts == sorted(counts) and counts[-1] > counts[0], result.stdout


def test_a_failed_build_shows_its_log_and_dies(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    result = bash(f"run_with_progress 'demo build' {log} bash -c 'echo compile error; exit 3'")
    assert result.returncode == 1
    assert "compile error" in result.stderr
    assert f"die: demo build failed; full log: {log}" in result.stderr


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        pytest.fail("go is not on PATH (the unit tier builds helm and NVIDIA's tools with it)")
    return go


def test_the_total_counts_the_packages_outside_the_standard_library(tmp_path: Path) -> None:
    _go()
    module = tmp_path / "m"
    (module / "inner").mkdir(parents=True)
    (module / "go.mod").write_text("module example.com/m\n\ngo 1.21\n")
    (module / "inner" / "inner.go").write_text(
        'package inner\n\nimport "strings"\n\nvar Up = strings.ToUpper\n'
    )
    (module / "main.go").write_text(
        'package main\n\nimport (\n\t"fmt"\n\n\t"example.com/m/inner"\n)\n\n'
        'func main() { fmt.Println(inner.Up("x")) }\n'
    )
    result = bash(
        f"count_go_packages 'resolving' {module} {tmp_path / 'list.log'} .\n"
        'echo "total=$GO_PACKAGES_TOTAL"',
        env={"GOFLAGS": "-mod=mod", "GOPROXY": "off", "GOTOOLCHAIN": "local", "GOWORK": "off"},
    )
    assert result.returncode == 0, result.stderr
    assert "total=2" in result.stdout  # example.com/m and example.com/m/inner


FAKE_GO = """#!/usr/bin/env bash
# Stands in for the Go toolchain: what hack/install-helm.sh asks of it, slowly.
case "$1 $2" in
  "mod download")
    printf '{\\n\\t"Path": "helm.sh/helm",\\n\\t"Dir": "%s",\\n' "$FAKE_SRC"
    printf '\\t"Sum": "h1:x"\\n}\\n' ;;
  "list -e")
    # an empty line: a standard-library package, which the template leaves empty
    printf 'helm.sh/helm/cmd/helm\\n\\nhelm.sh/helm/pkg/a\\n'
    printf 'helm.sh/helm/pkg/b\\nsigs.k8s.io/yaml\\n' ;;
  "install -v")
    echo "go: downloading sigs.k8s.io/yaml v1.6.0" >&2
    for p in sigs.k8s.io/yaml helm.sh/helm/pkg/a helm.sh/helm/pkg/b helm.sh/helm/cmd/helm; do
      sleep 0.3; echo "$p" >&2
    done
    printf '#!/bin/sh\\necho version.BuildInfo\\n' >"$GOBIN/helm"; chmod +x "$GOBIN/helm" ;;
  *) echo "fake go: unexpected: $*" >&2; exit 2 ;;
esac
"""


def test_the_helm_build_counts_compiled_packages_up_to_a_total(tmp_path: Path) -> None:
    """Before, the helm build printed `still building helm (N modules downloaded)`
    every 15 s, a count that stops changing once the downloads are done."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_go = bin_dir / "go"
    fake_go.write_text(FAKE_GO)
    fake_go.chmod(0o755)
    (tmp_path / "src").mkdir()
    env = {
        **os.environ,
        **FAST,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "GPU_DRA_CACHE": str(tmp_path / "cache"),
        "FAKE_SRC": str(tmp_path / "src"),
    }
    result = subprocess.run(
        ["bash", str(REPO / "hack" / "install-helm.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "up to 4 packages" in result.stderr  # the empty line is a std package
    counts = [
        int(n) for n in re.findall(r"helm build: .*?(\d+) of at most 4 packages", result.stderr)
    ]
    assert len(counts) >= 2 and counts[-1] > counts[0], result.stderr
    assert "modules downloaded" in result.stderr
    version = re.search(r"^HELM_VERSION=(\S+)", (REPO / "hack" / "versions.env").read_text(), re.M)
    assert version is not None
    assert result.stdout.strip().endswith(f"helm-v{version[1]}/helm")
