"""Runs gpu-kubelet-plugin as a real process against the test cluster."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DRIVER = "gpu.example.com"
# The short kubelet-like directories of this session's plugin instances.
_SHORT_DIRS: set[Path] = set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plugin_command(
    *,
    node_name: str,
    kubeconfig: Path,
    registry_dir: Path,
    plugins_dir: Path,
    cdi_root: Path,
    http_port: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """gpu-kubelet-plugin on mock GPUs with kubelet-like directories of its own."""
    return [
        sys.executable,
        "-m",
        "driver.plugin.main",
        f"--node-name={node_name}",
        f"--kubeconfig={kubeconfig}",
        f"--kubelet-registrar-directory-path={registry_dir}",
        f"--kubelet-plugins-directory-path={plugins_dir}",
        f"--cdi-root={cdi_root}",
        f"--http-port={http_port}",
        "--nvml-backend=mock",
        *extra,
    ]


class PluginProcess:
    """One plugin instance with its own kubelet-like directories under `root`."""

    def __init__(
        self,
        *,
        kubeconfig: Path,
        node_name: str,
        root: Path,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.node_name = node_name
        self.root = root
        # Unix socket paths must stay under 108 bytes, and pytest's tmp paths can be
        # long: the kubelet-like directories live under a short path derived from root.
        short = Path("/tmp") / f"gdra-{hashlib.sha1(str(root).encode()).hexdigest()[:10]}"
        # Restarts reuse it (same root), so it goes when the test session ends.
        if short not in _SHORT_DIRS:
            _SHORT_DIRS.add(short)
            atexit.register(shutil.rmtree, short, ignore_errors=True)
        self.registry_dir = short / "plugins_registry"
        self.plugins_dir = short / "plugins"
        self.cdi_root = short / "cdi"
        self.data_dir = self.plugins_dir / DRIVER
        self.env = env or {}
        # The mock GPUs' MIG state and capability files (the plugin's default place).
        self.mock_driver_root = Path(
            self.env.get("MOCK_DRIVER_ROOT") or self.data_dir / "mock-driver-root"
        )
        self.http_port = free_port()
        self.args = list(args)
        self.log_path = root / "plugin.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PluginProcess:
        command = plugin_command(
            node_name=self.node_name,
            kubeconfig=self.kubeconfig,
            registry_dir=self.registry_dir,
            plugins_dir=self.plugins_dir,
            cdi_root=self.cdi_root,
            http_port=self.http_port,
            extra=self.args,
        )
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
        )
        return self

    def wait_serving(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.http_port}/healthz", timeout=1
                ):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"plugin did not serve /healthz within {timeout}s:\n{self.logs()}")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"plugin exited with {self.proc.returncode}:\n{self.logs()}")

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            sample, value = line.rsplit(" ", 1)
            if sample.split("{")[0] != name:
                continue
            if labels and not all(f'{k}="{v}"' in sample for k, v in labels.items()):
                continue
            total += float(value)
        return total

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self.proc = None
        return code

    def cdi_specs(self) -> dict[str, dict[str, Any]]:
        if not self.cdi_root.is_dir():
            return {}
        return {p.name: json.loads(p.read_text()) for p in sorted(self.cdi_root.glob("*.json"))}


@contextmanager
def running_plugin(**kwargs: Any) -> Iterator[PluginProcess]:
    plugin = PluginProcess(**kwargs).start()
    try:
        plugin.wait_serving()
        yield plugin
    finally:
        plugin.stop()
