"""The chart's bound on the MPS daemons' /dev/shm (kubeletPlugin.mps.shmSize,
docs/mps.md "Directories, users and /dev/shm"): MPS_SHM_SIZE from the value (1Gi by
default), and the plugin's data directory mounted with Bidirectional propagation
where the plugin mounts a tmpfs that must reach the node: MPS on, a size, and a
privileged plugin (the nvml backend, or a securityContext that says so). The
unprivileged mock plugin may not mount (and may not ask for Bidirectional)."""

from __future__ import annotations

import pytest
from test_chart_render import MOCK_VALUES, Doc, helm_template, one, render

from driver.state.mps.shm import DEFAULT_SIZE, shm_size

MPS = ("--set", "kubeletPlugin.mps.enabled=true")


def _plugin(docs: list[Doc]) -> Doc:
    daemonset = one(docs, "DaemonSet", "kubeletplugin")
    (plugin,) = daemonset["spec"]["template"]["spec"]["containers"]
    return plugin


def _data_mount(docs: list[Doc]) -> Doc:
    (mount,) = [m for m in _plugin(docs)["volumeMounts"] if m["name"] == "plugin-data"]
    return mount


def _size(docs: list[Doc]) -> str:
    (env,) = [e for e in _plugin(docs)["env"] if e["name"] == "MPS_SHM_SIZE"]
    return str(env["value"])


def test_the_size_defaults_to_the_plugins_default_and_follows_the_value() -> None:
    assert _size(render()) == DEFAULT_SIZE == "1Gi"
    assert _size(render(*MPS, "--set", "kubeletPlugin.mps.shmSize=256Mi")) == "256Mi"
    assert shm_size(_size(render(*MPS, "--set", "kubeletPlugin.mps.shmSize=0"))) == 0


def test_a_privileged_plugin_with_mps_mounts_its_data_directory_bidirectionally() -> None:
    assert _data_mount(render(*MPS)).get("mountPropagation") == "Bidirectional"
    custom = ("--set", "kubeletPlugin.containers.plugin.securityContext.privileged=true")
    mock = ("-f", str(MOCK_VALUES))
    assert _data_mount(render(*mock, *MPS, *custom)).get("mountPropagation") == "Bidirectional"


@pytest.mark.parametrize(
    "args",
    [
        (),  # MPS off
        (*MPS, "-f", str(MOCK_VALUES)),  # the unprivileged mock plugin
        (*MPS, "--set", "kubeletPlugin.mps.shmSize=0"),  # no tmpfs
        (*MPS, "--set", "kubeletPlugin.containers.plugin.securityContext.runAsUser=0"),
    ],
    ids=["mps-off", "mock", "size-0", "unprivileged-security-context"],
)
def test_otherwise_the_data_directory_propagates_nothing(args: tuple[str, ...]) -> None:
    assert "mountPropagation" not in _data_mount(render(*args))


def test_a_size_that_is_not_a_quantity_is_refused() -> None:
    proc = helm_template(*MPS, "--set", "kubeletPlugin.mps.shmSize=lots", check=False)
    assert proc.returncode != 0
    assert "shmSize" in proc.stderr, proc.stderr


def test_a_real_nvml_plugin_with_mps_sees_the_hosts_processes_and_no_other_does() -> None:
    def host_pid(*args: str) -> bool:
        daemonset = one(render(*args), "DaemonSet", "kubeletplugin")
        return bool(daemonset["spec"]["template"]["spec"].get("hostPID"))

    assert host_pid(*MPS)
    assert not host_pid()
    assert not host_pid(*MPS, "-f", str(MOCK_VALUES))


def test_gpu_memory_limits_are_off_unless_asked_and_then_see_the_hosts_processes() -> None:
    def plugin_pod(*args: str) -> Doc:
        return one(render(*args), "DaemonSet", "kubeletplugin")["spec"]["template"]["spec"]

    def env(pod: Doc) -> str:
        (value,) = [
            e["value"] for e in pod["containers"][0]["env"] if e["name"] == "GPU_MEMORY_LIMITS"
        ]
        return str(value)

    off, on = plugin_pod(), plugin_pod("--set", "kubeletPlugin.gpuMemoryLimits=true")
    assert (env(off), bool(off.get("hostPID"))) == ("false", False)
    assert (env(on), bool(on.get("hostPID"))) == ("true", True)
