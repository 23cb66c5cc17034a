"""Supply chain: every locked package carries hashes, every install checks them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _lock_entries() -> dict[str, list[str]]:
    """Requirement line -> its --hash options, from requirements.lock."""
    text = (REPO / "requirements.lock").read_text().replace("\\\n", " ")
    entries: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        assert not line.startswith("-"), f"unexpected option line in requirements.lock: {line}"
        requirement = line.split()[0]
        entries[requirement] = re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
    return entries


def test_every_locked_requirement_is_pinned_with_hashes() -> None:
    entries = _lock_entries()
    assert len(entries) > 20
    for requirement, hashes in entries.items():
        assert re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", requirement), requirement
        assert hashes, f"{requirement} has no --hash in requirements.lock (run make lock)"
    assert any(r.startswith("pip==") for r in entries), "pip itself is not locked"


def _recipe(target: str) -> str:
    makefile = (REPO / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert match, f"no recipe for {target} in the Makefile"
    return match.group(1)


def test_makefile_venv_installs_with_require_hashes() -> None:
    recipe = _recipe("$(VENV)/.installed")
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    assert installs
    for line in installs:
        if " -e " in line:  # the project itself: no hash possible, nothing else fetched
            assert "--no-deps" in line and "--no-build-isolation" in line, line
        else:
            assert "--require-hashes" in line, line
    assert "lock:" in (REPO / "Makefile").read_text()


def _assert_online_pip_checks_hashes(path: Path) -> None:
    """Every pip wheel/install that may reach an index is --require-hashes -r the lock."""
    script = path.read_text().replace("\\\n", " ")
    pip_lines = [
        line
        for line in script.splitlines()
        if re.search(r"pip (wheel|install)", line)
        and not line.lstrip().startswith(("#", "progress"))
    ]
    assert pip_lines, f"no pip wheel/install in {path.name}"
    for line in pip_lines:
        if "--no-index" not in line:
            assert "--require-hashes" in line and "-r requirements.lock" in line, line
    assert "--constraint" not in script, f"{path.name} installs with --constraint"


def test_image_build_downloads_with_require_hashes() -> None:
    script = REPO / "hack" / "build-image.sh"
    _assert_online_pip_checks_hashes(script)
    assert "--keyring=" in script.read_text() and "--force-check-gpg" in script.read_text()


def test_dockerfile_installs_with_require_hashes_from_a_digest() -> None:
    _assert_online_pip_checks_hashes(REPO / "deployments" / "container" / "Dockerfile")
    kind_build = (REPO / "hack" / "kind" / "build-and-load-image.sh").read_text()
    assert "RepoDigests" in kind_build
    assert '--build-arg "PYTHON_IMAGE=$python_image"' in kind_build
