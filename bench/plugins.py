"""The two kubelet plugins under test, started the same way: own kubelet-like dirs,
same node, same driver name (gpu.example.com), same API server."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.integration.plugin_process import plugin_command

DRIVER = "gpu.example.com"


class PluginUnderTest:
    label = "plugin"

    def __init__(self, root: Path, kubeconfig: Path, node_name: str) -> None:
        self.root = root
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.registry_dir = root / "plugins_registry"
        self.plugins_dir = root / "plugins"
        self.cdi_root = root / "cdi"
        self.data_dir = self.plugins_dir / DRIVER
        self.log_path = root / "plugin.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawned_at = 0.0
        self.spawned_mono = 0.0

    def command(self, gpus: str) -> list[str]:
        raise NotImplementedError

    def start(self, gpus: str, env: dict[str, str] | None = None) -> PluginUnderTest:
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        cmd = self.command(gpus)
        self.spawned_at = time.perf_counter()
        self.spawned_mono = time.monotonic()  # the clock of RegisteredPlugin.registered_at
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
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
            f"--node-name={self.node_name}",
            f"--kubeconfig={self.kubeconfig}",
            f"--kubelet-registrar-directory-path={self.registry_dir}",
            f"--kubelet-plugins-directory-path={self.plugins_dir}",
            f"--cdi-root={self.cdi_root}",
            f"--num-devices={gpus}",
            "--device-profile=gpu",
            "--healthcheck-port=-1",
            "--metrics-port=-1",
            *self.extra_args,
        ]
