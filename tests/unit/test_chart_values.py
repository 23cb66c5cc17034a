"""Chart values as users of NVIDIA's charts and the reference chart write them: the
renamed values (old names still read for one release) and the Xid lists in every form
the docs give."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
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

from driver.health.xid import XidList, parse_xid_list


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
    assert env_of(plugin_container(docs))["NVIDIA_DRIVER_ROOT_HOST"]["value"] == "/"
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
    assert driver_root_host_path(render(*args)) == "/run/nvidia/driver"


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
    from driver.plugin.options.flags import parse_options

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


def test_notes_tell_how_to_check_that_the_daemonset_matched_gpu_nodes() -> None:
    """A DaemonSet that matches no node installs "successfully": the notes say how to
    see it (DESIRED 0) and which nodes the selection matches."""
    notes = install_notes()
    assert f"kubectl -n {NAMESPACE} get daemonset {RELEASE}-kubeletplugin" in notes
    assert "DESIRED 0" in notes and 'docs/install.md, "2. Node selection"' in notes
    assert "kubectl get nodes -l 'nvidia.com/gpu.present in (true)'" in notes
    assert "feature.node.kubernetes.io/pci-10de.present=true" in notes
    hardened = install_notes(
        "--set",
        "kubeletPlugin.gpuNodeLabel.key=node-restriction.kubernetes.io/gpu",
        "--set",
        "kubeletPlugin.gpuNodeLabel.nfdPciLabels=false",
    )
    assert "kubectl get nodes -l 'node-restriction.kubernetes.io/gpu in (true)'" in hardened
    assert "pci-10de" not in hardened
    every_node = install_notes("--set", "kubeletPlugin.gpuNodeLabel.key=")
    assert "get daemonset" in every_node and "kubectl get nodes -l" not in every_node


XID_VALUES = {
    "kubeletPlugin.health.fatalXids": ("FATAL_XIDS", "--fatal-xids"),
    "kubeletPlugin.health.additionalXidsToIgnore": (
        "ADDITIONAL_XIDS_TO_IGNORE",
        "--additional-xids-to-ignore",
    ),
}


@pytest.mark.parametrize("key", sorted(XID_VALUES))
@pytest.mark.parametrize(
    ("set_args", "file_value", "expected"),
    [
        (["--set", "{key}=79"], None, XidList(frozenset({79}))),
        (["--set", "{key}=all"], None, XidList(all=True)),
        (["--set", "{key}=79\\,48"], None, XidList(frozenset({48, 79}))),
        (["--set-string", "{key}=79"], None, XidList(frozenset({79}))),
        (["--set", "{key}={{79,48}}"], None, XidList(frozenset({48, 79}))),
        ([], [79, 48], XidList(frozenset({48, 79}))),
        ([], 4294967295, XidList(frozenset({4294967295}))),
        ([], "all", XidList(all=True)),
        ([], [], XidList()),
        ([], "", XidList()),
    ],
    ids=[
        "set-number",
        "set-all",
        "set-comma-string",
        "set-string-number",
        "set-list",
        "file-list",
        "file-largest-number",
        "file-all",
        "file-empty-list",
        "file-empty-string",
    ],
)
def test_xid_list_forms_reach_the_plugin_as_its_flag_expects(
    key: str,
    set_args: list[str],
    file_value: object,
    expected: XidList,
    tmp_path: Path,
) -> None:
    env_name, flag = XID_VALUES[key]
    args = [a.format(key=key) for a in set_args]
    if file_value is not None:
        *parents, leaf = key.split(".")
        tree: dict[str, object] = {leaf: file_value}
        for parent in reversed(parents):
            tree = {parent: tree}
        values = tmp_path / "values.yaml"
        values.write_text(yaml.safe_dump(tree))
        args = ["--values", str(values)]
    value = env_of(plugin_container(render(*args)))[env_name]["value"]
    assert isinstance(value, str)
    assert parse_xid_list(value, flag) == expected


@pytest.mark.parametrize("key", sorted(XID_VALUES))
@pytest.mark.parametrize(
    "bad",
    ["{key}=0", "{key}=79;48", "{key}=-5", "{key}={{79,abc}}", "{key}=4294967296", "{key}=true"],
)
def test_bad_xid_values_are_rejected_naming_the_value(key: str, bad: str) -> None:
    proc = helm_template("--set", bad.format(key=key), check=False)
    assert proc.returncode != 0
    assert "/kubeletPlugin/health/" + key.rsplit(".", 1)[1] in proc.stderr, proc.stderr
