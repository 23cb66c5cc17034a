"""Fixtures and the figures summary of the reliability suite.

The suite runs against the integration tier's real control plane (`cluster`, `node`
from tests/conftest.py) and real plugin processes. Each test records what
it survived in `FIGURES`; the session ends with a summary of them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.support import PLUGIN_DIRS

FIGURES: Counter[str] = Counter()

_HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability: fault-injection suite (tests/reliability)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not FIGURES:
        return
    terminalreporter.section("reliability figures")
    for key in sorted(FIGURES):
        terminalreporter.write_line(f"{key:<44} {FIGURES[key]:>8}")


@pytest.fixture
def figures() -> Counter[str]:
    return FIGURES


@pytest.fixture
def root() -> Iterator[Path]:
    """A short directory for a plugin's kubelet-like dirs (unix socket paths must stay
    under 108 bytes, which pytest's tmp_path does not guarantee)."""
    path = Path(tempfile.mkdtemp(prefix="rel-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
    for directory in list(PLUGIN_DIRS):
        if directory.is_dir() and not os.path.ismount(directory):
            shutil.rmtree(directory, ignore_errors=True)
        PLUGIN_DIRS.discard(directory)
