"""NVIDIA's kubelet plugin in the bench: the driver root it runs over, its command line
and environment, and what the results record of its build."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from bench.plugins import (
    NVIDIA_DRIVER,
    NVML_LIBRARY,
    NvidiaPlugin,
    device_nodes,
    driver_root_layout,
)
from bench.provenance import parse_go_build_info


class DeviceNodes:
    """Records the device nodes a layout asks for; each is left as an empty file, so
    a second layout over the same root sees it exists (mknod needs CAP_MKNOD)."""

    def __init__(self) -> None:
        self.made: list[tuple[Path, int, int]] = []

    def __call__(self, path: Path, major: int, minor: int) -> None:
        path.write_bytes(b"")
        self.made.append((path, major, minor))


def _mock_nvml(tmp_path: Path) -> Path:
    """A mock NVML build directory as its Makefile leaves it: the versioned library and
    the soname link."""
    build = tmp_path / "mocknvml"
    build.mkdir()
    (build / "libnvidia-ml.so.550.163.01").write_bytes(b"\x7fELF")
    (build / NVML_LIBRARY).symlink_to("libnvidia-ml.so.550.163.01")
    return build


def _plugin(tmp_path: Path, binary: Path | None = None) -> NvidiaPlugin:
    return NvidiaPlugin(
        binary or tmp_path / "gpu-kubelet-plugin",
        _mock_nvml(tmp_path),
        tmp_path / "run",
        tmp_path / "kubeconfig",
        "bench-node-1",
        extra_args=("--kube-api-qps=1000", "--kube-api-burst=1000"),
        make_node=DeviceNodes(),
    )


def test_driver_root_holds_the_mock_library_and_an_nvidia_smi_that_refuses(
    tmp_path: Path,
) -> None:
    build = _mock_nvml(tmp_path)
    root = tmp_path / "driver-root"
    nodes = DeviceNodes()
    assert driver_root_layout(build, root, 2, nodes) == "550.163.01"
    lib64 = root / "usr" / "lib64"
    library = lib64 / NVML_LIBRARY
    assert library.resolve() == (build / "libnvidia-ml.so.550.163.01").resolve()
    # The plugin's CDI spec generation looks both up by the driver version.
    assert (lib64 / "libnvidia-ml.so.550.163.01").resolve() == library.resolve()
    assert (lib64 / "libcuda.so.550.163.01").is_file()
    smi = root / "usr" / "bin" / "nvidia-smi"
    assert os.access(smi, os.X_OK)
    ran = subprocess.run([str(smi), "-L"], capture_output=True, text=True)
    assert ran.returncode != 0 and "not available" in ran.stderr
    made = list(nodes.made)
    driver_root_layout(build, root, 2, nodes)  # a restart lays it out again over the old one
    assert nodes.made == made  # no node made twice
    assert library.resolve() == (build / "libnvidia-ml.so.550.163.01").resolve()


def test_driver_root_has_the_device_nodes_of_its_gpus(tmp_path: Path) -> None:
    root = tmp_path / "driver-root"
    nodes = DeviceNodes()
    driver_root_layout(_mock_nvml(tmp_path), root, 2, nodes)
    found = {path.name: (major, minor) for path, major, minor in nodes.made}
    assert found == device_nodes(2)
    assert {path.parent for path, _, _ in nodes.made} == {root / "dev"}


def test_device_nodes_are_one_per_gpu_and_the_control_nodes() -> None:
    nodes = device_nodes(64)
    assert nodes["nvidia0"] == (195, 0) and nodes["nvidia63"] == (195, 63)
    assert "nvidia64" not in nodes
    assert nodes["nvidiactl"] == (195, 255)
    assert {"nvidia-uvm", "nvidia-uvm-tools"} <= set(nodes)


def test_driver_root_without_the_mock_library_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--nvidia-nvml-root"):
        driver_root_layout(tmp_path, tmp_path / "driver-root", 2)


def test_a_mock_library_without_a_version_in_its_name_is_refused(tmp_path: Path) -> None:
    build = tmp_path / "mocknvml"
    build.mkdir()
    (build / NVML_LIBRARY).write_bytes(b"\x7fELF")
    with pytest.raises(ValueError, match=re.escape("not libnvidia-ml.so.<version>")):
        driver_root_layout(build, tmp_path / "driver-root", 2)


def test_command_points_the_plugin_at_its_own_dirs_and_driver_root(tmp_path: Path) -> None:
    plugin = _plugin(tmp_path)
    cmd = plugin.command("64")
    run = tmp_path / "run"
    assert cmd[0] == str(tmp_path / "gpu-kubelet-plugin")
    for flag in (
        f"--kubelet-registrar-directory-path={run / 'plugins_registry'}",
        f"--kubelet-plugins-directory-path={run / 'plugins'}",
        f"--cdi-root={run / 'cdi'}",
        f"--nvidia-driver-root={run / 'driver-root'}",
        f"--container-driver-root={run / 'driver-root'}",
        "--node-name=bench-node-1",
        "--kube-api-qps=1000",
        "--kube-api-burst=1000",
    ):
        assert flag in cmd
    assert any(arg.startswith("--image-name=") for arg in cmd)  # a required flag
    assert plugin.driver == NVIDIA_DRIVER
    assert plugin.data_dir == run / "plugins" / NVIDIA_DRIVER


def test_start_lays_out_the_driver_root_and_tells_the_mock_its_gpus_and_version(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen"
    binary = tmp_path / "fake-plugin"
    binary.write_text(
        f'#!/bin/sh\necho "$MOCK_NVML_NUM_DEVICES $MOCK_NVML_DRIVER_VERSION" > {seen}\n'
    )
    binary.chmod(0o755)
    plugin = _plugin(tmp_path, binary)
    plugin.start("64")
    assert plugin.proc is not None
    assert plugin.proc.wait(10) == 0
    assert seen.read_text().strip() == "64 550.163.01"
    assert (tmp_path / "run" / "driver-root" / "usr" / "lib64" / NVML_LIBRARY).exists()


GO_VERSION_M = """\
{binary}: go1.26.8
\tpath\tsigs.k8s.io/dra-driver-nvidia-gpu/cmd/gpu-kubelet-plugin
\tmod\tsigs.k8s.io/dra-driver-nvidia-gpu\tv0.4.0-rc.1.0.20260807160054-959320466837\t
\tdep\tgithub.com/NVIDIA/go-nvml\tv0.13.0-1\t
\tbuild\t-buildmode=exe
\tbuild\tvcs=git
\tbuild\tvcs.revision=95932046683719c43b6a0dd9613c2e5aad5d6703
\tbuild\tvcs.modified=false
"""


def test_build_info_of_a_checkout_build_names_the_commit() -> None:
    binary = "/tmp/nv/gpu-kubelet-plugin"
    info = parse_go_build_info(binary, GO_VERSION_M.format(binary=binary))
    assert info == {
        "go": "go1.26.8",
        "package": "sigs.k8s.io/dra-driver-nvidia-gpu/cmd/gpu-kubelet-plugin",
        "module": "sigs.k8s.io/dra-driver-nvidia-gpu",
        "version": "v0.4.0-rc.1.0.20260807160054-959320466837",
        "vcs_revision": "95932046683719c43b6a0dd9613c2e5aad5d6703",
        "vcs_modified": False,
    }


def test_build_info_of_a_module_proxy_build_has_no_commit() -> None:
    binary = "/cache/dra-example-kubeletplugin"
    text = (
        f"{binary}: go1.26.8\n"
        "\tpath\tsigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin\n"
        "\tmod\tsigs.k8s.io/dra-example-driver\tv0.4.0\th1:abc=\n"
        "\tbuild\t-buildmode=exe\n"
    )
    info = parse_go_build_info(binary, text)
    assert info["version"] == "v0.4.0"
    assert "vcs_revision" not in info and "vcs_modified" not in info
