"""The real-GPU bundle carries every package the tier imports (hack/bundle_requirements.py).

The GPU host installs only the bundle's wheels, so the check runs the tier's collection and
imports every module of `driver` in a fresh interpreter in which every installed
distribution the bundle leaves out cannot be imported: a package the tier needs and the
bundle lacks fails collection here as it would on the GPU host.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bundle_requirements", REPO / "hack" / "bundle_requirements.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


BUNDLE = load_script()

ONLY_THE_BUNDLE = textwrap.dedent(
    """
    import importlib.abc, json, pkgutil, sys

    BLOCKED = set(json.loads(sys.argv[1]))

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"No module named {name!r} (not in the GPU bundle)")
            return None

    sys.meta_path.insert(0, Refuse())
    import driver
    for module in pkgutil.walk_packages(driver.__path__, "driver."):
        __import__(module.name)
    import pytest
    sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"]))
    """
)


def modules_outside(bundle: Iterable[str]) -> list[str]:
    """Top-level import names of the installed distributions that are not in `bundle`
    (a name also provided by a bundled distribution stays importable)."""
    keep = {BUNDLE.canonical(name) for name in bundle}
    provided = importlib.metadata.packages_distributions()
    return sorted(
        module
        for module, dists in provided.items()
        if not keep & {BUNDLE.canonical(d) for d in dists} and module not in ("driver", "tests")
    )


def collect_with_only(bundle: Iterable[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ONLY_THE_BUNDLE, json.dumps(modules_outside(bundle))],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_tier_collects_and_driver_imports_with_only_the_bundles_packages() -> None:
    _, why = BUNDLE.bundle()
    result = collect_with_only(why)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "test_real_nvml.py" in result.stdout


def test_a_package_left_out_of_the_bundle_fails_the_collection() -> None:
    _, why = BUNDLE.bundle()
    result = collect_with_only(set(why) - {"msgspec"})
    assert result.returncode != 0
    assert "'msgspec' (not in the GPU bundle)" in result.stdout + result.stderr


def test_every_bundled_package_is_a_locked_one_with_hashes() -> None:
    lock, why = BUNDLE.bundle()
    for name in why:
        assert any(line.lstrip().startswith("--hash=sha256:") for line in lock[name].lines), name


def test_the_lock_parser_follows_via_lines_through_several_parents() -> None:
    lock = BUNDLE.parse_lock(
        textwrap.dedent(
            """\
            a==1 \\
                --hash=sha256:00
                # via gpu-dra-driver (pyproject.toml)
            b==2 \\
                --hash=sha256:11
                # via
                #   a
                #   c
            c==3 \\
                --hash=sha256:22
                # via gpu-dra-driver (pyproject.toml)
            d==4 \\
                --hash=sha256:33
                # via b
            """
        )
    )
    assert BUNDLE.closure(lock, ["a"]) == {"a": "root", "b": "needed by a", "d": "needed by b"}
    assert set(BUNDLE.closure(lock, ["c"])) == {"c", "b", "d"}
