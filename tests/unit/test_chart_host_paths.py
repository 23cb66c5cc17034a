"""The chart refuses the directory values the plugin would refuse at start
(driver/plugin/options/host_inputs.py): a bad value fails `helm install`, not the pods."""

from __future__ import annotations

import pytest
from test_chart_render import helm_template, one, render

from driver.plugin.options.host_inputs import check_path

WRITTEN = (
    "kubeletPlugin.cdiRoot",
    "kubeletPlugin.kubeletPluginsDirectoryPath",
    "kubeletPlugin.kubeletRegistrarDirectoryPath",
)
REFUSED = ("/etc", "/", "/var/../etc", "//cdi", "/usr/", "/proc/1/root", "cdi")
ACCEPTED = ("/etc/cdi", "/var/run/cdi", "/run/cdi", "/var/lib/kubelet/plugins", "/opt/dra")


@pytest.mark.parametrize("key", WRITTEN)
@pytest.mark.parametrize("value", REFUSED)
def test_written_directories_the_plugin_refuses_fail_the_install(key: str, value: str) -> None:
    with pytest.raises(ValueError):  # the plugin's own check, for parity
        check_path(value, written=True)
    proc = helm_template("--set", f"{key}={value}", check=False)
    assert proc.returncode != 0
    assert key.split(".")[-1] in proc.stderr


@pytest.mark.parametrize("value", ACCEPTED)
def test_usual_directories_render(value: str) -> None:
    check_path(value, written=True)
    helm_template("--set", f"kubeletPlugin.cdiRoot={value}")


@pytest.mark.parametrize("value", ["/usr/../bin/nvidia-cdi-hook", "//hook", "bin/hook"])
def test_cdi_hook_path_must_be_absolute_and_normalised(value: str) -> None:
    with pytest.raises(ValueError):
        check_path(value, written=False)
    proc = helm_template("--set", f"nvidiaCDIHookPath={value}", check=False)
    assert proc.returncode != 0 and "nvidiaCDIHookPath" in proc.stderr


def test_a_mistyped_registrar_directory_is_not_created_on_the_node() -> None:
    """The kubelet's plugin watcher creates `<kubelet --root-dir>/plugins_registry` when
    it starts, before it runs pods, so the chart needs it to exist rather than create it
    (hostPath type Directory). A misspelt kubeletRegistrarDirectoryPath then fails the
    pod's mount, and no directory with a registration socket no kubelet reads is made
    on every node, to outlive a rollback."""
    typo = "/var/lib/kubelet/plugins_registri"
    docs = render("--set", f"kubeletPlugin.kubeletRegistrarDirectoryPath={typo}")
    volumes = {v["name"]: v for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["plugins-registry"]["hostPath"] == {"path": typo, "type": "Directory"}
