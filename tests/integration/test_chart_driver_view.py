"""The chart's mounts of a host-installed driver keep the common CDI spec NVIDIA's.

With `nvidiaDriverRoot: /` the plugin does not see the host's root, only the
directories the chart mounts under /driver-root (`nvidiaDriverHostDirectories`). Its
common CDI spec must still equal what `nvidia-ctk cdi generate` makes on the host,
where nvcdi searches the whole root: libraries in the standard directories and then
/etc/ld.so.cache, binaries on PATH, GSP firmware, graphics configs in /etc and
/usr/share, the daemons' sockets in /run and /var/run.

Here a fake node is laid out as a distribution installs the driver (a merged-/usr
Debian/Ubuntu host, a RHEL-like one, the H200 test host with the driver under
/usr/local/nvidia), with its ld cache made by ldconfig. The chart is rendered with
helm, the plugin container's hostPath mounts are bind-mounted (read-only, in a private
mount namespace) from the fake host onto a stand-in /driver-root, and the plugin's own
`generate` runs gpu-dra-cdi-common there with the fake host's root as the host path;
nvidia-ctk runs on the whole fake host. The init container's script runs over the same
mounts and must find the driver.

Runs as root (mknod, mount, ldconfig -r). Nothing skips.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cdi.driver_edits import DriverEditsError, DriverRoot, generate
from tests.fake_driver import DRIVER_VERSION, FakeDriver, make_driver_root
from tests.integration.test_cdi_generator import (
    HOOK_PATH,
    PATH,
    Tools,
    hook_list,
    mount_set,
    run_tool,
)
from tests.integration.test_cdi_generator import tools as tools  # the session fixture
from tests.unit.test_chart_render import CHART, Doc, one, plugin_container, render

VALUES = CHART / "values.yaml"
CONTAINER_DRIVER_ROOT = "/driver-root"
# Graphics and OpenCL configs where the driver's packages put them (nvcdi looks for
# them under /etc, /usr/local/share and /usr/share), and where the spec mounts them.
CONFIGS = {
    "usr/share/glvnd/egl_vendor.d/10_nvidia.json": "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json": (
        "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json"
    ),
    "usr/share/nvidia/nvoptix.bin": "/usr/share/nvidia/nvoptix.bin",
    "usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf": (
        "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"
    ),
    "usr/share/vulkan/icd.d/nvidia_icd.json": "/etc/vulkan/icd.d/nvidia_icd.json",
    "etc/vulkan/implicit_layer.d/nvidia_layers.json": (
        "/etc/vulkan/implicit_layer.d/nvidia_layers.json"
    ),
    "etc/OpenCL/vendors/nvidia.icd": "/etc/OpenCL/vendors/nvidia.icd",
}
TOOLKIT_CONFIG = "etc/nvidia-container-runtime/config.toml"
SOCKETS = ("run/nvidia-persistenced/socket", "run/nvidia-fabricmanager/socket")
MERGED_USR = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
H200_DRIVER = "/usr/local/nvidia"
DEFAULT_DIRECTORIES: list[str] = yaml.safe_load(VALUES.read_text())["nvidiaDriverHostDirectories"]


@dataclass(frozen=True)
class Bind:
    source: Path  # on the fake host
    target: Path  # in the stand-in for the container's filesystem


def _bind_socket(path: Path) -> None:
    """A unix socket file, as a daemon leaves it (bound by a relative name: the
    absolute path may exceed sun_path's 108 bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.chdir(path.parent), socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path.name)


def _ld_cache(root: Path, lib_dir: str) -> None:
    """/etc/ld.so.cache as ldconfig writes it on the node, the driver's directory listed
    in /etc/ld.so.conf.d as the driver's packages do."""
    conf = root / "etc" / "ld.so.conf.d"
    conf.mkdir(parents=True, exist_ok=True)
    (root / "etc" / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (conf / "nvidia.conf").write_text(f"{lib_dir}\n")
    proc = subprocess.run(
        ["ldconfig", "-r", str(root)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, f"ldconfig -r {root}: {proc.stderr}"
    assert (root / "etc" / "ld.so.cache").is_file()


def fake_host(
    root: Path, standin: Path, lib_dir: str, bin_dir: str, *, merged_usr: bool
) -> FakeDriver:
    """A node with the driver installed: its libraries, binaries and firmware, the
    configs and sockets above, /var/run a link to /run, the ld cache."""
    root.mkdir()
    (root / "usr").mkdir()
    if merged_usr:
        for link, target in MERGED_USR.items():
            (root / target).mkdir(parents=True, exist_ok=True)
            (root / link).symlink_to(target)
    (root / "run").mkdir()
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("../run")
    driver = make_driver_root(root, standin, lib_dir, bin_dir)
    for name in (*CONFIGS, TOOLKIT_CONFIG):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{name} of the fake driver\n")
    for name in SOCKETS:
        _bind_socket(root / name)
    _ld_cache(root, lib_dir)
    return driver


def debian_host(root: Path, standin: Path) -> FakeDriver:
    return fake_host(root, standin, "/usr/lib/x86_64-linux-gnu", "/usr/bin", merged_usr=True)


def rhel_host(root: Path, standin: Path) -> FakeDriver:
    return fake_host(root, standin, "/usr/lib64", "/usr/bin", merged_usr=True)


def h200_host(root: Path, standin: Path) -> FakeDriver:
    """The GPU tier's H200 host: the driver in /usr/local/nvidia (bin/, lib64/), in the
    ld cache, and /usr/bin/nvidia-smi a shell script that runs it."""
    driver = fake_host(root, standin, f"{H200_DRIVER}/lib64", f"{H200_DRIVER}/bin", merged_usr=True)
    wrapper = root / "usr" / "bin" / "nvidia-smi"
    wrapper.write_text(f'#!/bin/sh\nexec {H200_DRIVER}/bin/nvidia-smi "$@"\n')
    wrapper.chmod(0o755)
    return driver


@dataclass(frozen=True)
class ContainerView:
    """A container of the plugin's pod as the chart makes it: its hostPath mounts of the
    driver (at /driver-root and, for the init container of a dedicated driver root,
    /driver-root-parent) as binds from the fake host into `fs`, a stand-in for the
    container's filesystem, and its environment."""

    fs: Path
    binds: tuple[Bind, ...]
    env: dict[str, str]

    def path(self, container_path: str) -> Path:
        return self.fs / container_path.lstrip("/")


def container_view(container: Doc, pod: Doc, host: Path, fs: Path) -> ContainerView:
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    binds = []
    for mount in container["volumeMounts"]:
        path = mount["mountPath"]
        if mount["name"] not in host_paths or not path.startswith(CONTAINER_DRIVER_ROOT):
            continue
        assert mount.get("readOnly") is True, mount
        source = host / host_paths[mount["name"]].lstrip("/")
        source.mkdir(parents=True, exist_ok=True)  # hostPath DirectoryOrCreate
        target = fs / path.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        binds.append(Bind(source, target))
    assert binds, f"{container['name']} mounts nothing at {CONTAINER_DRIVER_ROOT}"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return ContainerView(fs, tuple(binds), env)


@dataclass(frozen=True)
class PodView:
    plugin: ContainerView
    init: ContainerView
    init_script: str
    host_root: Path  # NVIDIA_DRIVER_ROOT_HOST on the fake host


def pod_view(host: Path, tmp: Path, *helm_args: str) -> PodView:
    docs = render(*helm_args)
    pod: Doc = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    plugin = container_view(plugin_container(docs), pod, host, tmp / "plugin-fs")
    assert plugin.env["NVIDIA_DRIVER_ROOT"] == CONTAINER_DRIVER_ROOT, plugin.env
    (init,) = pod["initContainers"]
    return PodView(
        plugin=plugin,
        init=container_view(init, pod, host, tmp / "init-fs"),
        init_script=init["command"][-1],
        host_root=host / plugin.env["NVIDIA_DRIVER_ROOT_HOST"].lstrip("/"),
    )


def in_mounts(wrapper: Path, binds: tuple[Bind, ...], command: list[str]) -> Path:
    """An executable that runs `command` with its arguments in a private mount
    namespace holding the binds, read-only, as the container runtime mounts them."""
    steps = [
        f"mount --bind {shlex.quote(str(b.source))} {shlex.quote(str(b.target))}"
        f" && mount -o remount,bind,ro {shlex.quote(str(b.target))}"
        for b in binds
    ]
    inner = "\n".join(["set -e", *steps, 'exec "$@"'])
    argv = " ".join(shlex.quote(a) for a in command)
    wrapper.write_text(
        f'#!/bin/sh\nexec unshare --mount -- /bin/sh -c {shlex.quote(inner)} sh {argv} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def nvidia_ctk_edits(tools: Tools, host: Path, driver_root: Path) -> dict[str, Any]:
    out = run_tool(
        [
            str(tools.nvidia_ctk),
            "cdi",
            "generate",
            "--mode",
            "nvml",
            "--driver-root",
            str(driver_root),
            "--dev-root",
            str(host),
            "--nvidia-cdi-hook-path",
            HOOK_PATH,
            "--format",
            "json",
        ],
        host,
    )
    edits: dict[str, Any] = json.loads(out)["containerEdits"]
    return edits


def plugin_edits(tools: Tools, view: PodView, tmp: Path) -> dict[str, Any]:
    """The plugin's own generation (driver.cdi.driver_edits.generate, as CommonSpec
    runs it) for its driver root, over its mounts."""
    generator = in_mounts(tmp / "generator-in-mounts", view.plugin.binds, [str(tools.cdi_common)])
    root = DriverRoot(view.plugin.path(CONTAINER_DRIVER_ROOT), view.host_root, HOOK_PATH)
    return dict(generate(root, generator).edits)


@pytest.fixture
def generator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", PATH)
    monkeypatch.setenv("NVML_STANDIN_DRIVER_VERSION", DRIVER_VERSION)


def assert_same_edits(ours: dict[str, Any], ctk: dict[str, Any]) -> None:
    assert mount_set(ours) == mount_set(ctk), (
        f"only nvidia-ctk: {sorted(mount_set(ctk) - mount_set(ours))}\n"
        f"only the plugin: {sorted(mount_set(ours) - mount_set(ctk))}"
    )
    assert hook_list(ours) == hook_list(ctk)
    assert sorted(ours.get("env") or []) == sorted(ctk.get("env") or [])


def run_init(tmp: Path, view: PodView) -> subprocess.CompletedProcess[str]:
    """The init container's script over its mounts. Its `sleep` between checks ends
    the script instead: one pass, found or not."""
    stop = tmp / "stop-bin"
    stop.mkdir(exist_ok=True)
    (stop / "sleep").write_text("#!/bin/sh\nkill -KILL $PPID\n")
    (stop / "sleep").chmod(0o755)
    script = ["/bin/sh", "-c", view.init_script]
    wrapper = in_mounts(tmp / "init-in-mounts", view.init.binds, script)
    env = {
        **view.init.env,
        "PATH": f"{stop}:{PATH}",
        "DRIVER_ROOT": str(view.init.path(view.init.env["DRIVER_ROOT"])),
    }
    return subprocess.run(
        [str(wrapper)], capture_output=True, text=True, timeout=60, env=env, check=False
    )


@pytest.mark.parametrize("layout", [debian_host, rhel_host], ids=["debian", "rhel"])
def test_the_default_mounts_give_the_plugin_nvidia_ctks_common_spec(
    tools: Tools,
    tmp_path: Path,
    generator_env: None,
    layout: Any,
) -> None:
    """Merged /usr, the libraries in /usr/lib/<arch>-linux-gnu or /usr/lib64: the spec
    over the default mounts is nvidia-ctk's over the whole host, and the init
    container finds libnvidia-ml.so.1 through the same mounts."""
    host = tmp_path / "host"
    driver = layout(host, tools.nvml_standin)
    view = pod_view(host, tmp_path)
    assert view.host_root == host

    ctk = nvidia_ctk_edits(tools, host, host)
    ours = plugin_edits(tools, view, tmp_path)
    assert_same_edits(ours, ctk)
    # The fake driver's files are all there, by their host paths.
    container_paths = {m[0] for m in mount_set(ours)}
    assert set(CONFIGS.values()) <= container_paths, sorted(container_paths)
    assert f"{driver.lib_dir}/libcuda.so.{DRIVER_VERSION}" in container_paths
    assert "/run/nvidia-persistenced/socket" in container_paths

    init = run_init(tmp_path, view)
    assert init.returncode == 0, init.stdout + init.stderr
    assert f"found the NVIDIA driver: {driver.lib_dir}/libnvidia-ml.so.1 on the host" in init.stdout


def test_a_directory_added_to_the_defaults_brings_its_files(
    tools: Tools,
    tmp_path: Path,
    generator_env: None,
) -> None:
    """A host without merged /usr whose driver libraries are in /lib64: the defaults
    miss them (no spec, the init container waits) until the operator adds /lib64, as
    docs/install.md shows."""
    host = tmp_path / "host"
    driver = fake_host(host, tools.nvml_standin, "/lib64", "/usr/bin", merged_usr=False)
    ctk = nvidia_ctk_edits(tools, host, host)
    assert f"/lib64/libcuda.so.{DRIVER_VERSION}" in {m[0] for m in mount_set(ctk)}

    defaults = pod_view(host, tmp_path / "defaults")
    with pytest.raises(DriverEditsError, match="libcuda"):
        plugin_edits(tools, defaults, tmp_path)
    assert run_init(tmp_path, defaults).returncode != 0

    added = json.dumps([*DEFAULT_DIRECTORIES, "/lib64"])
    view = pod_view(host, tmp_path / "added", "--set-json", f"nvidiaDriverHostDirectories={added}")
    assert_same_edits(plugin_edits(tools, view, tmp_path), ctk)
    init = run_init(tmp_path, view)
    assert init.returncode == 0, init.stdout + init.stderr
    assert f"found the NVIDIA driver: {driver.lib_dir}/libnvidia-ml.so.1" in init.stdout


def test_a_driver_found_only_through_the_ld_cache_takes_its_own_driver_root(
    tools: Tools,
    tmp_path: Path,
    generator_env: None,
) -> None:
    """The H200 host: the driver's libraries in /usr/local/nvidia/lib64, found by
    nvidia-ctk on the host through /etc/ld.so.cache only. The plugin and its init
    container look in the standard library directories, with or without the host's
    root mounted, so nvidiaDriverRoot "/" does not find this driver: the init container
    keeps waiting and says where it looked. nvidiaDriverRoot=/usr/local/nvidia does,
    and the spec is nvidia-ctk's for that driver root."""
    host = tmp_path / "host"
    driver = h200_host(host, tools.nvml_standin)
    whole_host = {m[0] for m in mount_set(nvidia_ctk_edits(tools, host, host))}
    assert f"{driver.lib_dir}/libcuda.so.{DRIVER_VERSION}" in whole_host

    at_root = pod_view(host, tmp_path / "at-root")
    waiting = run_init(tmp_path, at_root)
    assert waiting.returncode != 0
    assert "waiting for the NVIDIA driver: no libnvidia-ml.so.1" in waiting.stdout
    with pytest.raises(DriverEditsError, match="libcuda"):
        plugin_edits(tools, at_root, tmp_path)

    view = pod_view(host, tmp_path / "own", "--set", f"nvidiaDriverRoot={H200_DRIVER}")
    assert view.host_root == host / H200_DRIVER.lstrip("/")
    ctk = nvidia_ctk_edits(tools, host, view.host_root)
    ours = plugin_edits(tools, view, tmp_path)
    assert_same_edits(ours, ctk)
    assert f"/lib64/libcuda.so.{DRIVER_VERSION}" in {m[0] for m in mount_set(ours)}
    init = run_init(tmp_path, view)
    assert init.returncode == 0, init.stdout + init.stderr
    assert f"found the NVIDIA driver: {H200_DRIVER}/lib64/libnvidia-ml.so.1" in init.stdout
