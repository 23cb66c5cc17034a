"""What of the host the plugin and its init container see of a driver installed on the
host (nvidiaDriverRoot "/"): the directories the driver's files are in, never the
host's whole root (kubelet credentials, /etc/shadow)."""

from __future__ import annotations

import pytest
from test_chart_render import Doc, env_of, helm_template, one, plugin_container, render

from driver.nvml.library import LIBRARY_DIRS, NVML_LIBRARY
from driver.nvml.smi_timeslice import BINARY, BINARY_DIRS
from driver.plugin.toolkit_config import TOOLKIT_CONFIG

DEFAULT_DIRS = [
    "/usr",
    "/lib/firmware",
    "/etc/nvidia-container-runtime",
    "/etc/vulkan",
    "/etc/OpenCL/vendors",
    "/run/nvidia-persistenced",
    "/run/nvidia-fabricmanager",
]


def _pod(docs: list[Doc]) -> Doc:
    pod: Doc = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return pod


def _host_paths(pod: Doc) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}


def _driver_mounts(container: Doc, pod: Doc) -> dict[str, str]:
    """mountPath -> host path of the container's driver-root mounts."""
    hosts = _host_paths(pod)
    return {
        m["mountPath"]: hosts[m["name"]]
        for m in container["volumeMounts"]
        if m["name"].startswith("driver-root")
    }


def test_host_root_is_never_mounted_by_default() -> None:
    pod = _pod(render())
    assert "/" not in _host_paths(pod).values(), _host_paths(pod)
    containers = [*pod["initContainers"], *pod["containers"]]
    for container in containers:
        mounts = _driver_mounts(container, pod)
        assert mounts == {f"/driver-root{d}": d for d in DEFAULT_DIRS}, container["name"]
        for mount in container["volumeMounts"]:
            if mount["name"].startswith("driver-root"):
                assert mount["readOnly"] is True
                assert mount["mountPropagation"] == "HostToContainer"
    (init,) = pod["initContainers"]
    assert {e["name"]: e["value"] for e in init["env"]}["DRIVER_ROOT"] == "/driver-root"
    assert env_of(plugin_container(render()))["NVIDIA_DRIVER_ROOT_HOST"]["value"] == "/"


def test_what_the_plugin_reads_under_the_driver_root_is_mounted() -> None:
    """libnvidia-ml (NVML, the init container's wait), nvidia-smi (time slices) and the
    toolkit's config lie under a mount in at least one of the places they are looked
    for; everything under the mounts keeps its host path below /driver-root."""
    pod = _pod(render())
    mounts = _driver_mounts(plugin_container(render()), pod)

    def mounted(relative: str) -> bool:
        path = f"/driver-root/{relative}"
        return any(path.startswith(m + "/") and mounts[m] == m[len("/driver-root") :]
                   for m in mounts)  # fmt: skip

    assert any(mounted(f"{d}/{NVML_LIBRARY}") for d in LIBRARY_DIRS)
    assert any(mounted(f"{d}/{BINARY}") for d in BINARY_DIRS)
    assert mounted(str(TOOLKIT_CONFIG))
    assert mounted("lib/firmware/nvidia/580.95.05/gsp_ga10x.bin")
    assert mounted("run/nvidia-persistenced/socket")
    assert not mounted("etc/kubernetes/kubelet.conf")
    assert not mounted("var/lib/kubelet/pki/kubelet-client-current.pem")
    assert not mounted("etc/shadow")


def test_host_directories_can_be_chosen() -> None:
    docs = render("--set-json", 'nvidiaDriverHostDirectories=["/usr","/lib64"]')
    pod = _pod(docs)
    assert _driver_mounts(plugin_container(docs), pod) == {
        "/driver-root/usr": "/usr",
        "/driver-root/lib64": "/lib64",
    }


@pytest.mark.parametrize(
    "value", ['["/"]', '["usr"]', '["/usr/../etc"]', '["/usr//lib"]', "[]"]
)  # fmt: skip
def test_bad_host_directories_are_refused(value: str) -> None:
    proc = helm_template("--set-json", f"nvidiaDriverHostDirectories={value}", check=False)
    assert proc.returncode != 0
    assert "nvidiaDriverHostDirectories" in proc.stderr, proc.stderr


def test_a_dedicated_driver_root_is_mounted_whole() -> None:
    docs = render("--set", "nvidiaDriverRoot=/run/nvidia/driver")
    pod = _pod(docs)
    assert _driver_mounts(plugin_container(docs), pod) == {"/driver-root": "/run/nvidia/driver"}
