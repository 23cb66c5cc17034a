"""Chart values as users of NVIDIA's charts and the reference chart write them: the
renamed values (old names still read for one release)."""

from __future__ import annotations

import subprocess

import pytest
from test_chart_render import (
    CHART,
    MOCK_VALUES,
    NAMESPACE,
    RELEASE,
    Doc,
    env_of,
    find_helm,
    helm_template,
    one,
    plugin_container,
    render,
)


def driver_root_host_path(docs: list[Doc]) -> str:
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "driver-root"]
    return str(volume["hostPath"]["path"])


def verbosity(docs: list[Doc]) -> str:
    return str(env_of(plugin_container(docs))["V"]["value"])


def install_notes(*args: str) -> str:
    """What `helm install` prints after installing (NOTES.txt), without a cluster."""
    install = [find_helm(), "install", "--dry-run=client", RELEASE, str(CHART)]
    proc = subprocess.run(
        [*install, "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\nNOTES:\n", 1)[1]


def test_defaults() -> None:
    docs = render()
    assert driver_root_host_path(docs) == "/usr"
    assert verbosity(docs) == "2"
    assert verbosity(render("--values", str(MOCK_VALUES))) == "4"


@pytest.mark.parametrize(
    "args",
    [
        ["--set", "nvidiaDriverRoot=/run/nvidia/driver"],
        ["--set", "nvml.driverRoot=/run/nvidia/driver/"],
        [
            "--set",
            "nvml.driverRoot=/run/nvidia/driver",
            "--set",
            "nvidiaDriverRoot=/run/nvidia/driver",
        ],
    ],
    ids=["new", "old", "both-alike"],
)
def test_nvidia_driver_root(args: list[str]) -> None:
    assert driver_root_host_path(render(*args)) == "/run/nvidia/driver/usr"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--set", "logVerbosity=5"], "5"),
        (["--set-string", "logVerbosity=6"], "6"),
        (["--set", "logging.verbosity=7"], "7"),
        (["--set", "logging.verbosity=3", "--set", "logVerbosity=3"], "3"),
        (["--values", str(MOCK_VALUES), "--set", "logVerbosity=0"], "0"),
    ],
    ids=["new", "new-as-string", "old", "both-alike", "over-mock-values"],
)
def test_log_verbosity(args: list[str], expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from driver.plugin.flags import parse_options

    value = verbosity(render(*args))
    assert value == expected
    monkeypatch.setenv("V", value)
    assert parse_options(["--node-name=n"]).verbosity == int(expected)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--set", "nvml.driverRoot=/a", "--set", "nvidiaDriverRoot=/b"],
            "nvml.driverRoot (deprecated) and nvidiaDriverRoot are both set, to different "
            "values: set only nvidiaDriverRoot",
        ),
        (
            ["--set", "logging.verbosity=3", "--set", "logVerbosity=4"],
            "logging.verbosity (deprecated) and logVerbosity are both set",
        ),
        (["--set", "logVerbosity=11"], "/logVerbosity"),
        (["--set", "logVerbosity=loud"], "/logVerbosity"),
        (["--set", "logging.verbosity=-1"], "/logging/verbosity"),
        (["--set", "nvidiaDriverRoot=run/nvidia"], "/nvidiaDriverRoot"),
        (["--set", "nvml.driverRoot=run/nvidia"], "/nvml/driverRoot"),
    ],
)
def test_conflicting_or_bad_values_fail_naming_them(args: list[str], message: str) -> None:
    proc = helm_template(*args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_old_names_print_a_deprecation_note() -> None:
    notes = install_notes("--set", "nvml.driverRoot=/a", "--set", "logging.verbosity=3")
    assert "DEPRECATED: the value nvml.driverRoot" in notes
    assert "set nvidiaDriverRoot instead" in notes
    assert "DEPRECATED: the value logging.verbosity" in notes
    assert "set logVerbosity instead" in notes
    assert "DEPRECATED" not in install_notes("--set", "nvidiaDriverRoot=/a")
