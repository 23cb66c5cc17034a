"""The NVIDIA Container Toolkit's config under the driver root: where the toolkit
accepts NVIDIA_VISIBLE_DEVICES from unprivileged pods, a pod without a claim gets
every GPU. The plugin warns (log, /status note, metric)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from driver.observability import metrics
from driver.plugin.toolkit_config import (
    ENVVAR_KEY,
    TOOLKIT_CONFIG,
    check_toolkit_config,
    report_toolkit_check,
)
from tests.unit.test_status_cli import Node, node  # noqa: F401 (fixture)


def write_config(root: Path, text: str) -> Path:
    path = root / TOOLKIT_CONFIG
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def result_gauge(result: str) -> float | None:
    value: float | None = metrics.REGISTRY.get_sample_value(
        "gpu_dra_nvidia_toolkit_config", {"result": result}
    )
    return value


@pytest.mark.parametrize(
    "text", [f"{ENVVAR_KEY} = true\n", "disable-require = false\n"], ids=["true", "unset"]
)
def test_a_toolkit_that_accepts_the_envvar_is_warned_about(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_config(tmp_path, text)
    check = check_toolkit_config(tmp_path)
    assert check.result == "accepts-envvar"
    assert check.warning is not None
    assert str(path) in check.warning and f"{ENVVAR_KEY} = false" in check.warning
    with caplog.at_level(logging.WARNING):
        report_toolkit_check(check)
    assert check.warning in caplog.text
    assert result_gauge("accepts-envvar") == 1.0 and result_gauge("hardened") == 0.0


def test_a_hardened_toolkit_is_no_warning(tmp_path: Path) -> None:
    write_config(tmp_path, f"{ENVVAR_KEY} = false\n[nvidia-container-cli]\nldconfig = '@x'\n")
    check = check_toolkit_config(tmp_path)
    assert (check.result, check.warning) == ("hardened", None)
    report_toolkit_check(check)
    assert result_gauge("hardened") == 1.0 and result_gauge("accepts-envvar") == 0.0


def test_no_config_and_an_unreadable_one_are_said(tmp_path: Path) -> None:
    assert check_toolkit_config(tmp_path).result == "no-config"
    path = write_config(tmp_path, f"{ENVVAR_KEY} = 'no'\n")
    check = check_toolkit_config(tmp_path)
    assert check.result == "unreadable"
    assert check.warning is not None and str(path) in check.warning
    assert ENVVAR_KEY in check.warning


def test_status_shows_the_toolkit_check(node: Node, tmp_path: Path) -> None:  # noqa: F811
    write_config(tmp_path, f"{ENVVAR_KEY} = true\n")
    node.status.toolkit = check_toolkit_config(tmp_path)
    document = node.status.document()
    assert document["nvidiaToolkit"]["result"] == "accepts-envvar"
    assert node.status.toolkit.warning in document["notes"]
