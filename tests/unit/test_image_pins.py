"""The Dockerfile's base images are pinned by digest, and
deployments/container/base-images.sh checks and refreshes the pins (against a stand-in
container tool that answers `pull` and `image inspect` as Docker does)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from test_chart_render import REPO

CONTAINER = REPO / "deployments" / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
SCRIPT = CONTAINER / "base-images.sh"
PINNED = re.compile(r"^[^@\s]+:[^@/:\s]+@sha256:[0-9a-f]{64}$")
OLD, NEW = "1" * 64, "2" * 64

# A `docker` that knows two tags: `pull` succeeds, `image inspect` prints the
# RepoDigests line of the tag's repository with the digest in $DIGESTS/<repository>.
FAKE_TOOL = """#!/bin/sh
case "$1" in
  pull) exit 0 ;;
  image) eval "ref=\\${$#}"; repo=${ref%%:*}
         printf '%s@sha256:%s\\n' "$repo" "$(cat "$DIGESTS/$repo")" ;;
  *) exit 3 ;;
esac
"""


def dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def test_every_base_image_is_pinned_by_digest() -> None:
    text = DOCKERFILE.read_text()
    args = dockerfile_args(text)
    for arg in ("PYTHON_IMAGE", "GOLANG_IMAGE"):
        assert PINNED.match(args[arg]), f"ARG {arg}={args[arg]} is not <name>:<tag>@sha256:..."
    stages = set(re.findall(r"^FROM .* AS (\S+)$", text, flags=re.MULTILINE))
    for base in re.findall(r"^FROM (?:--\S+ )*(\S+)", text, flags=re.MULTILINE):
        assert base in {"${PYTHON_IMAGE}", "${GOLANG_IMAGE}"} | stages, f"unpinned FROM {base}"


@pytest.fixture
def copy(tmp_path: Path) -> dict[str, str]:
    """A copy of the Dockerfile pinned at OLD, a fake tool whose tags are at OLD."""
    dockerfile = tmp_path / "Dockerfile"
    text = DOCKERFILE.read_text()
    for arg, ref in dockerfile_args(text).items():
        if arg.endswith("_IMAGE"):
            text = text.replace(f"ARG {arg}={ref}", f"ARG {arg}={ref.split('@')[0]}@sha256:{OLD}")
    dockerfile.write_text(text)
    digests = tmp_path / "digests"
    digests.mkdir()
    for repo in ("python", "golang"):
        (digests / repo).write_text(OLD)
    tool = tmp_path / "docker"
    tool.write_text(FAKE_TOOL)
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return {
        **os.environ,
        "DOCKERFILE": str(dockerfile),
        "CONTAINER_TOOL": str(tool),
        "DIGESTS": str(digests),
    }


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_check_says_which_tag_moved_and_refresh_rewrites_only_its_pin(
    copy: dict[str, str],
) -> None:
    dockerfile = Path(copy["DOCKERFILE"])
    assert run(copy, "check").returncode == 0
    Path(copy["DIGESTS"], "python").write_text(NEW)
    check = run(copy, "check")
    assert check.returncode == 1
    assert f"PYTHON_IMAGE python:3.11-slim-bookworm: pinned sha256:{OLD}" in check.stdout
    assert f"now at sha256:{NEW}" in check.stdout and "refresh" in check.stdout
    assert "GOLANG_IMAGE golang:1.26-bookworm: pinned digest is current" in check.stdout

    before = dockerfile.read_text()
    refresh = run(copy, "refresh")
    assert refresh.returncode == 0, refresh.stderr
    after = dockerfile.read_text()
    args = dockerfile_args(after)
    assert args["PYTHON_IMAGE"] == f"python:3.11-slim-bookworm@sha256:{NEW}"
    assert args["GOLANG_IMAGE"] == f"golang:1.26-bookworm@sha256:{OLD}"
    assert after.replace(NEW, OLD) == before  # nothing else changed
    assert run(copy, "check").returncode == 0


def test_a_bare_tag_is_refused_and_refresh_pins_it(copy: dict[str, str]) -> None:
    dockerfile = Path(copy["DOCKERFILE"])
    dockerfile.write_text(
        re.sub(r"^(ARG GOLANG_IMAGE=[^@]+)@\S+$", r"\1", dockerfile.read_text(), flags=re.M)
    )
    listed = run(copy, "list")
    assert listed.returncode == 1
    assert "ARG GOLANG_IMAGE=golang:1.26-bookworm is not pinned" in listed.stderr
    assert run(copy, "refresh").returncode == 0
    assert run(copy, "pinned", "GOLANG_IMAGE").stdout.strip() == (
        f"golang:1.26-bookworm@sha256:{OLD}"
    )


def test_the_kind_build_uses_the_pins() -> None:
    """hack/kind/build-and-load-image.sh builds from the Dockerfile's pins (checked, or
    refreshed with --refresh-base-images), never from a bare tag of its own."""
    script = (REPO / "hack" / "kind" / "build-and-load-image.sh").read_text()
    assert '"$BASE_IMAGES" pinned PYTHON_IMAGE' in script
    assert '"$BASE_IMAGES" pinned GOLANG_IMAGE' in script
    assert '"$BASE_IMAGES" check' in script and '"$BASE_IMAGES" refresh' in script
    assert not re.search(r"python:3\.11-slim-bookworm|golang:1\.26-bookworm", script)
