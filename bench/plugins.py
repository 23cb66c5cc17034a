"""The kubelet plugins under test, started the same way: own kubelet-like dirs, same
node, same API server. This driver and the reference publish driver gpu.example.com;
NVIDIA's plugin publishes gpu.nvidia.com (`PluginUnderTest.driver`)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.integration.plugin_process import plugin_command

DRIVER = "gpu.example.com"
NVIDIA_DRIVER = "gpu.nvidia.com"
NVML_LIBRARY = "libnvidia-ml.so.1"


class PluginUnderTest:
    label = "plugin"
    driver = DRIVER

    def __init__(self, root: Path, kubeconfig: Path, node_name: str) -> None:
        self.root = root
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.registry_dir = root / "plugins_registry"
        self.plugins_dir = root / "plugins"
        self.cdi_root = root / "cdi"
        self.data_dir = self.plugins_dir / self.driver
        self.log_path = root / "plugin.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawned_at = 0.0
        self.spawned_mono = 0.0

    def command(self, gpus: str) -> list[str]:
        raise NotImplementedError

    def kubelet_plugin_flags(self) -> list[str]:
        """The node, API and directory flags of a Go kubelet plugin built on
        k8s.io/dynamic-resource-allocation's kubeletplugin (the reference's and NVIDIA's)."""
        return [
            f"--node-name={self.node_name}",
            f"--kubeconfig={self.kubeconfig}",
            f"--kubelet-registrar-directory-path={self.registry_dir}",
            f"--kubelet-plugins-directory-path={self.plugins_dir}",
            f"--cdi-root={self.cdi_root}",
        ]

    def command_env(self, gpus: str) -> dict[str, str]:
        """Environment the plugin needs for `gpus`, beyond the bench's own."""
        return {}

    def start(self, gpus: str, env: dict[str, str] | None = None) -> PluginUnderTest:
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        cmd = self.command(gpus)
        env = {**self.command_env(gpus), **(env or {})}
        self.spawned_at = time.perf_counter()
        self.spawned_mono = time.monotonic()  # the clock of RegisteredPlugin.registered_at
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.label} exited with {self.proc.returncode}:\n{self.logs()}")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def wipe(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


class OursPlugin(PluginUnderTest):
    label = "this driver"

    def __init__(
        self, root: Path, kubeconfig: Path, node_name: str, http_port: int, pycache: Path
    ) -> None:
        super().__init__(root, kubeconfig, node_name)
        self.http_port = http_port
        self.pycache = pycache

    def start(self, gpus: str, env: dict[str, str] | None = None) -> PluginUnderTest:
        # Run from compiled bytecode, as an installed package does (pip compiles at
        # install): with PYTHONDONTWRITEBYTECODE a source checkout would recompile
        # every module of the driver at each start (an empty value unsets it). The
        # cache lives outside the tree.
        bytecode = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(self.pycache)}
        return super().start(gpus, {**bytecode, **(env or {})})

    def command(self, gpus: str) -> list[str]:
        """`gpus`: `default` (8 H100, MIG), or a fleet file path."""
        return plugin_command(
            node_name=self.node_name,
            kubeconfig=self.kubeconfig,
            registry_dir=self.registry_dir,
            plugins_dir=self.plugins_dir,
            cdi_root=self.cdi_root,
            http_port=self.http_port,
            extra=[f"--mock-fleet={gpus}"],
        )

    def handler_seconds(self) -> tuple[float, float]:
        """(sum, count) of the plugin's own `gpu_dra_prepare_seconds` histogram: the time
        inside its NodePrepareResources handler, without the gRPC transport."""
        return (
            self.metric("gpu_dra_prepare_seconds_sum"),
            self.metric("gpu_dra_prepare_seconds_count"),
        )

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of metric `name` (a counter's `_total` sample too)
        whose labels include `labels`, from the plugin's /metrics."""
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        total = 0.0
        found = False
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            sample_name, _, sample_labels = sample.partition("{")
            if sample_name.removesuffix("_total") != name.removesuffix("_total"):
                continue
            if all(w in sample_labels for w in wanted):
                total += float(value)
                found = True
        if not found:
            raise RuntimeError(f"{name}{labels or ''} not in the plugin's /metrics")
        return total


class ReferencePlugin(PluginUnderTest):
    """The Go reference (sigs.k8s.io/dra-example-driver cmd/dra-example-kubeletplugin)."""

    label = "reference"

    def __init__(
        self,
        binary: Path,
        root: Path,
        kubeconfig: Path,
        node_name: str,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(root, kubeconfig, node_name)
        self.binary = binary
        self.extra_args = extra_args

    def command(self, gpus: str) -> list[str]:
        """`gpus`: the number of GPUs (--num-devices)."""
        return [
            str(self.binary),
            *self.kubelet_plugin_flags(),
            f"--num-devices={gpus}",
            "--device-profile=gpu",
            "--healthcheck-port=-1",
            "--metrics-port=-1",
            *self.extra_args,
        ]


def make_device_node(path: Path, major: int, minor: int) -> None:
    """A character device node (CAP_MKNOD: the bench runs as root)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except PermissionError as err:
        raise PermissionError(
            f"NVIDIA's plugin needs device nodes in its driver root; mknod {path}"
            f" was refused ({err.strerror}): run the bench as root"
        ) from err


class NvidiaPlugin(PluginUnderTest):
    """NVIDIA's gpu-kubelet-plugin (kubernetes-sigs/dra-driver-nvidia-gpu), built from a
    checkout, over NVIDIA's mock NVML (NVIDIA/k8s-test-infra pkg/gpu/mocknvml).

    The plugin finds libnvidia-ml.so.1 and nvidia-smi under its driver root; the bench
    lays one out per start (`driver_root_layout`). The mock NVML simulates
    MOCK_NVML_NUM_DEVICES GPUs; more than 8 needs the mock's device cap raised.
    """

    label = "NVIDIA's plugin"
    driver = NVIDIA_DRIVER

    def __init__(
        self,
        binary: Path,
        nvml_dir: Path,
        root: Path,
        kubeconfig: Path,
        node_name: str,
        extra_args: tuple[str, ...] = (),
        make_node: Callable[[Path, int, int], None] = make_device_node,
    ) -> None:
        super().__init__(root, kubeconfig, node_name)
        self.binary = binary
        self.nvml_dir = nvml_dir
        self.make_node = make_node
        self.driver_root = root / "driver-root"
        self.driver_version = ""
        self.extra_args = extra_args

    def start(self, gpus: str, env: dict[str, str] | None = None) -> PluginUnderTest:
        self.driver_version = driver_root_layout(
            self.nvml_dir, self.driver_root, int(gpus), self.make_node
        )
        return super().start(gpus, env)

    def command_env(self, gpus: str) -> dict[str, str]:
        # The driver version NVML reports must be the one the library files carry.
        return {"MOCK_NVML_NUM_DEVICES": gpus, "MOCK_NVML_DRIVER_VERSION": self.driver_version}

    def command(self, gpus: str) -> list[str]:
        """`gpus`: the number of mock GPUs (the environment carries it to the mock)."""
        return [
            str(self.binary),
            *self.kubelet_plugin_flags(),
            f"--nvidia-driver-root={self.driver_root}",
            f"--container-driver-root={self.driver_root}",
            f"--host-root={self.root / 'host-root'}",
            # Written into the CDI specs for the container runtime; never run here.
            f"--nvidia-cdi-hook-path={self.driver_root / 'usr' / 'bin' / 'nvidia-cdi-hook'}",
            "--image-name=unused.invalid/bench",  # required; renders MPS templates only
            "--healthcheck-port=-1",
            *self.extra_args,
        ]


def driver_root_layout(
    nvml_dir: Path,
    driver_root: Path,
    gpus: int,
    make_node: Callable[[Path, int, int], None] = make_device_node,
) -> str:
    """Lay out a driver root NVIDIA's plugin accepts and return the driver version.

    dev/ holds the device nodes of a node with `gpus` GPUs (the majors and minors of
    NVIDIA's kernel driver): the plugin's CDI specs inject them, and a GPU without its
    node gets an empty, invalid spec. `make_node` creates each one that is missing.

    usr/lib64 gets the mock's library under its soname and its versioned name (the
    version is the versioned file's suffix, as the mock's Makefile names it), and an
    empty libcuda.so.<version>: the plugin's CDI specs name it for containers, and
    nothing here loads it. usr/bin gets a stand-in nvidia-smi, which the plugin must
    find at start but runs only for sharing settings (time-slicing, compute mode) the
    bench never asks for; it fails loudly if it is ever run.
    """
    library = nvml_dir / NVML_LIBRARY
    if not library.is_file():
        raise FileNotFoundError(
            f"--nvidia-nvml-root: {library} not found (build NVIDIA's mock NVML there)"
        )
    real = library.resolve()
    version = real.name.removeprefix("libnvidia-ml.so.")
    if not re.fullmatch(r"\d+(\.\d+)+", version):
        raise ValueError(
            f"--nvidia-nvml-root: {library} resolves to {real.name}, not libnvidia-ml.so.<version>"
        )
    lib64 = driver_root / "usr" / "lib64"
    bin_dir = driver_root / "usr" / "bin"
    lib64.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in (NVML_LIBRARY, real.name):
        link = lib64 / name
        link.unlink(missing_ok=True)
        link.symlink_to(real)
    (lib64 / f"libcuda.so.{version}").write_bytes(b"")
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'bench: nvidia-smi is not available on the mock' >&2\nexit 1\n")
    smi.chmod(0o755)
    dev = driver_root / "dev"
    dev.mkdir(exist_ok=True)
    for name, (major, minor) in device_nodes(gpus).items():
        if not (dev / name).exists():
            make_node(dev / name, major, minor)
    return version


def device_nodes(gpus: int) -> dict[str, tuple[int, int]]:
    """The /dev entries of NVIDIA's kernel driver on a node with `gpus` GPUs, with their
    (major, minor) numbers."""
    nodes = {f"nvidia{minor}": (195, minor) for minor in range(gpus)}
    return nodes | {"nvidiactl": (195, 255), "nvidia-uvm": (510, 0), "nvidia-uvm-tools": (510, 1)}
