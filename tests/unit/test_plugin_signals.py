"""gpu-kubelet-plugin stops on SIGTERM whichever of its threads the kernel hands the
signal to: a process-directed signal goes to any thread that does not block it, and
Python runs the handler only in the main thread."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def signal_thread(pid: int, tid: int, signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tid, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill {pid}/{tid}")


def test_a_sigterm_received_by_another_thread_stops_the_plugin(short_dir: Path) -> None:
    kubeconfig = short_dir / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        'clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]\n'
        "users: [{name: u, user: {token: x}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    registry = short_dir / "registry"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "driver.plugin.main",
            "--node-name=n1",
            f"--kubeconfig={kubeconfig}",
            "--nvml-backend=mock",
            f"--kubelet-plugins-directory-path={short_dir / 'plugins'}",
            f"--kubelet-registrar-directory-path={registry}",
            f"--cdi-root={short_dir / 'cdi'}",
            "--http-port=-1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (registry.exists() and any(registry.iterdir())):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "never registered"
            time.sleep(0.02)
        worker = next(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        signal_thread(proc.pid, worker, signal.SIGTERM)
        try:
            output = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM ignored: the plugin still runs 10 s later")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output
    assert "received SIGTERM" in output and "shutting down" in output, output
    assert not any(registry.iterdir()), "the registration socket outlived the plugin"
