"""gpu-dra-cdi-common against NVIDIA's own CDI generator on a fake driver installation.

The driver's CDI specs carry the driver's libraries, binaries, firmware, IPC sockets,
control device nodes and nvidia-cdi-hook hooks as NVIDIA's generator produces them:
cmd/gpu-dra-cdi-common calls the toolkit's nvcdi in nvml mode (``GetCommonEdits``).
Here the same files are laid out in a temporary driver root the way a driver install
does (ELF libraries with their SONAMEs and soname links, executables, GSP firmware, the
persistenced socket, character device nodes), and the top-level ``containerEdits`` of
``nvidia-ctk cdi generate --mode nvml`` must equal gpu-dra-cdi-common's.

nvcdi loads NVML from the driver root (``libnvidia-ml.so.1`` found by its library
locator) to learn the driver version and, for nvidia-ctk, to list the GPUs: the root's
``libnvidia-ml.so.<version>`` is a copy of hack/nvml-standin (a stand-in for this
generator only, built by hack/build-nvml-standin.sh). Nothing on the host is touched
or read but the two binaries, which hack/build-nvidia-tools.sh builds.

Runs as root (device nodes are made with mknod). A missing binary or tool fails the
tests and names what is missing; nothing skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fake_driver import (
    BINARIES,
    CONTROL_NODES,
    DEVICE_NODES,
    DRIVER_VERSION,
    FIRMWARE,
    LIBRARIES,
    NVIDIA_MAJOR,
    UVM_MAJOR,
    FakeDriver,
    make_driver_root,
)

REPO = Path(__file__).resolve().parents[2]
HOOK_PATH = "/opt/hook/nvidia-cdi-hook"
# The generators search PATH (under the driver root) for the driver's executables.
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BUILD_TIMEOUT = 1500  # seconds; a cold nvidia-ctk build on 2 cores takes minutes

# A cold build of the tools runs inside the session fixture.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT + 300)


@dataclass(frozen=True)
class Tools:
    nvidia_ctk: Path
    cdi_common: Path
    nvml_standin: Path


def _build(script: str, what: str) -> Path:
    """Run a hack/ build script (a no-op when cached); its last stdout line is a path."""
    try:
        proc = subprocess.run(
            ["bash", str(REPO / "hack" / script)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"hack/{script} ({what}) did not finish in {BUILD_TIMEOUT}s")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        pytest.fail(f"hack/{script} ({what}) failed (exit {proc.returncode}):\n{tail}")
    return Path(lines[-1])


@pytest.fixture(scope="session")
def tools() -> Tools:
    bin_dir = _build("build-nvidia-tools.sh", "nvidia-ctk, nvidia-cdi-hook, gpu-dra-cdi-common")
    standin = _build("build-nvml-standin.sh", "the NVML stand-in libnvidia-ml.so")
    t = Tools(bin_dir / "nvidia-ctk", bin_dir / "gpu-dra-cdi-common", standin)
    missing = [
        str(p) for p in (t.nvidia_ctk, t.cdi_common) if not (p.is_file() and os.access(p, os.X_OK))
    ]
    if not t.nvml_standin.is_file():
        missing.append(str(t.nvml_standin))
    if missing:
        pytest.fail(
            f"missing after the builds: {', '.join(missing)}; run hack/build-nvidia-tools.sh "
            "and hack/build-nvml-standin.sh and check their logs"
        )
    return t


@pytest.fixture
def persistenced_socket(tmp_path: Path) -> Iterator[Path]:
    """root/run/nvidia-persistenced/socket, a listening unix socket as the daemon's."""
    run_dir = tmp_path / "root" / "run" / "nvidia-persistenced"
    run_dir.mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound by a relative name: the absolute path may exceed sun_path's 108 bytes.
    with contextlib.chdir(run_dir):
        sock.bind("socket")
    sock.listen(1)
    try:
        yield run_dir / "socket"
    finally:
        sock.close()


def run_tool(cmd: list[str], root: Path) -> str:
    env = {
        "PATH": PATH,
        "HOME": os.environ.get("HOME", "/root"),
        "NVML_STANDIN_DRIVER_VERSION": DRIVER_VERSION,
        "NVML_STANDIN_GPU_COUNT": "2",
    }
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env=env, cwd=root, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr.strip()[-4000:]}"
    )
    return proc.stdout


def nvidia_ctk_spec(tools: Tools, root: Path) -> dict[str, Any]:
    out = run_tool(
        [
            str(tools.nvidia_ctk),
            "cdi",
            "generate",
            "--mode",
            "nvml",
            "--driver-root",
            str(root),
            "--dev-root",
            str(root),
            "--nvidia-cdi-hook-path",
            HOOK_PATH,
            "--format",
            "json",
        ],
        root,
    )
    spec: dict[str, Any] = json.loads(out)
    return spec


def cdi_common(tools: Tools, root: Path) -> dict[str, Any]:
    out = run_tool(
        [
            str(tools.cdi_common),
            "--driver-root",
            str(root),
            "--nvidia-cdi-hook-path",
            HOOK_PATH,
        ],
        root,
    )
    result: dict[str, Any] = json.loads(out)
    return result


def mount_set(edits: dict[str, Any]) -> set[tuple[str, str, tuple[str, ...]]]:
    return {
        (m["containerPath"], m["hostPath"], tuple(m.get("options") or ()))
        for m in edits.get("mounts") or []
    }


def hook_list(edits: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    return [
        (h["hookName"], h["path"], tuple(h.get("args") or ()), tuple(h.get("env") or ()))
        for h in edits.get("hooks") or []
    ]


def node_set(edits: dict[str, Any]) -> set[str]:
    return {json.dumps(d, sort_keys=True) for d in edits.get("deviceNodes") or []}


def hook_args(edits: dict[str, Any], name: str) -> list[str]:
    """The arguments after the subcommand of every nvidia-cdi-hook `name` hook."""
    args: list[str] = []
    for hook in edits.get("hooks") or []:
        if hook["args"][1:2] == [name]:
            assert hook["path"] == HOOK_PATH, hook
            assert hook["args"][0] == "nvidia-cdi-hook", hook
            args += hook["args"][2:]
    return args


def check_against_nvidia_ctk(tools: Tools, driver: FakeDriver) -> None:
    root = driver.root
    spec = nvidia_ctk_spec(tools, root)
    ours = cdi_common(tools, root)
    assert ours["driverVersion"] == DRIVER_VERSION
    ctk, common = spec["containerEdits"], ours["containerEdits"]

    # nvidia-ctk listed the NVML stand-in's two GPUs, each with its device node.
    devices = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert {"0", "1", "all"} <= set(devices), sorted(devices)
    for index in (0, 1):
        (node,) = devices[str(index)]["deviceNodes"]
        assert node["path"] == f"/dev/nvidia{index}"
        assert node["hostPath"] == f"{root}/dev/nvidia{index}"
        assert (node.get("major", 0), node.get("minor", 0)) == DEVICE_NODES[f"nvidia{index}"]

    assert mount_set(common) == mount_set(ctk), (
        f"only nvidia-ctk: {sorted(mount_set(ctk) - mount_set(common))}\n"
        f"only gpu-dra-cdi-common: {sorted(mount_set(common) - mount_set(ctk))}"
    )
    assert hook_list(common) == hook_list(ctk)
    assert node_set(common) == node_set(ctk)
    assert sorted(common.get("env") or []) == sorted(ctk.get("env") or [])

    # What the driver root holds is what the edits carry.
    mounts = {m[0]: m for m in mount_set(common)}
    for name in LIBRARIES:
        path = f"{driver.lib_dir}/{name}.{DRIVER_VERSION}"
        assert path in mounts, f"{path} not mounted: {sorted(mounts)}"
        assert mounts[path][1] == f"{root}{path}"
        assert "ro" in mounts[path][2]
    for name in BINARIES:
        assert f"{driver.bin_dir}/{name}" in mounts, f"{name} not mounted: {sorted(mounts)}"
    for name in FIRMWARE:
        assert f"/lib/firmware/nvidia/{DRIVER_VERSION}/{name}" in mounts
    nodes = {d["path"]: d for d in common["deviceNodes"]}
    assert set(nodes) == {f"/dev/{n}" for n in CONTROL_NODES}
    for name in CONTROL_NODES:
        major, minor = DEVICE_NODES[name]
        node = nodes[f"/dev/{name}"]
        assert node["hostPath"] == f"{root}/dev/{name}"
        assert (node.get("major", 0), node.get("minor", 0)) == (major, minor)

    links = hook_args(common, "create-symlinks")
    assert f"libcuda.so.1::{driver.lib_dir}/libcuda.so" in links, links
    assert f"libnvidia-ml.so.{DRIVER_VERSION}::{driver.lib_dir}/libnvidia-ml.so.1" in links, links
    assert hook_args(common, "update-ldcache") == ["--folder", driver.lib_dir]
    assert f"--host-driver-version={DRIVER_VERSION}" in hook_args(common, "enable-cuda-compat")


def test_debian_layout_matches_nvidia_ctk(
    tools: Tools, tmp_path: Path, persistenced_socket: Path
) -> None:
    driver = make_driver_root(
        tmp_path / "root", tools.nvml_standin, "/usr/lib/x86_64-linux-gnu", "/usr/bin"
    )
    check_against_nvidia_ctk(tools, driver)
    ours = cdi_common(tools, driver.root)["containerEdits"]
    ipc = [m for m in ours["mounts"] if m["containerPath"] == "/run/nvidia-persistenced/socket"]
    assert ipc and ipc[0]["hostPath"] == str(persistenced_socket), ours["mounts"]
    assert "noexec" in ipc[0]["options"]


def test_gke_layout_matches_nvidia_ctk(tools: Tools, tmp_path: Path) -> None:
    """GKE's driver installer: lib64/ and bin/ under /home/kubernetes/bin/nvidia."""
    driver = make_driver_root(tmp_path / "root", tools.nvml_standin, "/lib64", "/bin")
    check_against_nvidia_ctk(tools, driver)


HOST_ROOT = "/run/nvidia/driver"  # where the GPU Operator's driver container puts it


def host_view(edits: dict[str, Any], root: Path) -> dict[str, Any]:
    """nvidia-ctk's edits with this test's driver root moved to HOST_ROOT, the transform
    the plugin asks for (--target-driver-root)."""
    return {
        **edits,
        "mounts": [
            {**m, "hostPath": m["hostPath"].replace(str(root), HOST_ROOT, 1)}
            for m in edits.get("mounts") or []
        ],
    }


def test_the_plugins_common_spec_carries_what_nvidia_ctk_generates(
    tools: Tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's own path: CommonSpec runs gpu-dra-cdi-common for a driver root
    mounted elsewhere than on the host, writes the common CDI spec, and a prepare after
    a driver upgrade (another libcuda.so.<version>) rewrites it for the new driver."""
    from driver.cdi.claim_specs import CdiSpecs
    from driver.cdi.common_spec import CommonSpec
    from driver.cdi.driver_edits import DriverRoot as PluginDriverRoot

    monkeypatch.setenv("PATH", PATH)
    monkeypatch.setenv("NVML_STANDIN_DRIVER_VERSION", DRIVER_VERSION)
    driver = make_driver_root(
        tmp_path / "root", tools.nvml_standin, "/usr/lib/x86_64-linux-gnu", "/usr/bin"
    )
    ctk = host_view(nvidia_ctk_spec(tools, driver.root)["containerEdits"], driver.root)
    proc_devices = tmp_path / "proc-devices"
    proc_devices.write_text(
        f"Character devices:\n{NVIDIA_MAJOR} nvidia\n{UVM_MAJOR} nvidia-uvm\n\nBlock devices:\n"
    )
    specs = CdiSpecs(tmp_path / "cdi", "gpu.example.com")
    common = CommonSpec(
        specs,
        "node-a",
        PluginDriverRoot(driver.root, Path(HOST_ROOT), HOOK_PATH),
        proc_devices=proc_devices,
        generator=tools.cdi_common,
    )
    common.write()

    def written() -> dict[str, Any]:
        doc = json.loads(specs.common_spec_path.read_bytes())
        (device,) = doc["devices"]
        edits: dict[str, Any] = device["containerEdits"]
        return edits

    edits = written()
    assert mount_set(edits) == mount_set(ctk)
    assert all(m[1].startswith(f"{HOST_ROOT}/") or m[1] == "/dev/null" for m in mount_set(edits))
    assert hook_list(edits) == hook_list(ctk)
    assert set(edits["env"]) == {
        "KUBERNETES_NODE_NAME=node-a",
        "DRA_RESOURCE_DRIVER_NAME=gpu.example.com",
        *ctk["env"],
    }
    # Control nodes complete, from /proc/devices, not the generator's path-only ones.
    ctl = {n["path"]: n for n in edits["deviceNodes"]}
    assert ctl["/dev/nvidiactl"] == {
        "path": "/dev/nvidiactl",
        "type": "c",
        "major": NVIDIA_MAJOR,
        "minor": 255,
        "fileMode": 0o666,
    }
    assert (ctl["/dev/nvidia-uvm-tools"]["major"], ctl["/dev/nvidia-uvm-tools"]["minor"]) == (
        UVM_MAJOR,
        1,
    )

    # Unchanged driver: a refresh writes nothing.
    before = specs.common_spec_path.stat().st_mtime_ns
    common.refresh()
    assert specs.common_spec_path.stat().st_mtime_ns == before

    # The driver container is upgraded in place: the old version's files are gone.
    libs = driver.root / driver.lib_dir.lstrip("/")
    new_version = "580.105.08"
    for path in libs.glob(f"*.so.{DRIVER_VERSION}"):
        path.rename(libs / path.name.replace(DRIVER_VERSION, new_version))
    for link in libs.iterdir():
        if link.is_symlink():
            target = os.readlink(link).replace(DRIVER_VERSION, new_version)
            link.unlink()
            link.symlink_to(target)
    firmware = driver.root / "lib/firmware/nvidia"
    (firmware / DRIVER_VERSION).rename(firmware / new_version)
    monkeypatch.setenv("NVML_STANDIN_DRIVER_VERSION", new_version)
    common.refresh()
    mounts = {m[0] for m in mount_set(written())}
    assert f"{driver.lib_dir}/libcuda.so.{new_version}" in mounts
    assert not any(DRIVER_VERSION in m for m in mounts), sorted(mounts)


def test_runc_started_with_the_specs_gets_the_driver_and_its_nodes(
    tools: Tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness the real-GPU tier starts `nvidia-smi -L` with (tests/cdi_bundle.py):
    runc with exactly a claim's CDI devices, over a busybox root, gets the device nodes,
    the driver's nvidia-smi and libraries, and NVIDIA's hooks run (links, ld cache)."""
    from driver.cdi.claim_specs import CdiDevice, CdiSpecs, ClaimSpec
    from driver.cdi.common_spec import CommonSpec
    from driver.cdi.device_nodes import DeviceNode
    from driver.cdi.driver_edits import DriverRoot as PluginDriverRoot
    from tests import cdi_bundle

    monkeypatch.setenv("PATH", PATH)
    monkeypatch.setenv("NVML_STANDIN_DRIVER_VERSION", DRIVER_VERSION)
    driver = make_driver_root(tmp_path / "root", tools.nvml_standin, "/usr/lib64", "/usr/bin")
    proc_devices = tmp_path / "proc-devices"
    proc_devices.write_text(f"Character devices:\n{NVIDIA_MAJOR} nvidia\n\nBlock devices:\n")
    specs = CdiSpecs(tmp_path / "cdi", "gpu.example.com")
    hook = str(tools.cdi_common.parent / "nvidia-cdi-hook")
    root = PluginDriverRoot(driver.root, driver.root, hook)
    CommonSpec(specs, "n", root, proc_devices=proc_devices, generator=tools.cdi_common).write()
    gpu1 = DeviceNode("/dev/nvidia1", NVIDIA_MAJOR, 1, 0o666)
    specs.write_claim_spec("c", ClaimSpec((CdiDevice("c-gpu-1", ("A=1",), (gpu1,)),)))
    docs = [json.loads(p.read_text()) for p in sorted(specs.root.iterdir())]

    rootfs = tmp_path / "rootfs"
    for d in ("bin", "etc", "dev", "proc", "sys", "tmp"):
        (rootfs / d).mkdir(parents=True)
    (rootfs / "bin/busybox").write_bytes(Path("/bin/busybox").read_bytes())
    (rootfs / "bin/busybox").chmod(0o755)
    (rootfs / "bin/sh").symlink_to("busybox")
    show = "ls -ln /dev | grep nvidia; nvidia-smi; busybox grep -c libcuda.so.1 /etc/ld.so.cache"
    proc = cdi_bundle.run(
        tmp_path / "bundle",
        rootfs,
        docs,
        ["k8s.gpu.example.com/gpu=c-gpu-1", "k8s.gpu.example.com/gpu=common"],
        ["sh", "-c", show],
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    nodes = {line.split()[-1] for line in lines if line.startswith("c")}
    assert nodes == {"nvidia1", "nvidiactl"}, proc.stdout  # no UVM module in this /proc
    assert f"nvidia-smi of the fake driver {DRIVER_VERSION}" in lines, proc.stdout
    assert int(lines[-1]) >= 1, proc.stdout
