"""The real NVML path never loads the mock.

A plugin on a GPU node runs `select_backend(mock=False)`: the mock package (and msgspec,
which only the mock's fleet files need) must not be imported there, so a node image or
bundle without them works and no fake device code sits in a production process. The
check runs in a fresh interpreter in which `driver.nvml.mock` and `msgspec` cannot be
imported at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BLOCK_MOCK = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = ("driver.nvml.mock", "msgspec")

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"{name} is blocked: the real NVML path imported it")
            return None

    sys.meta_path.insert(0, Refuse())
    """
)


def run_without_mock(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_MOCK + textwrap.dedent(body)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_real_backend_discovers_and_serves_without_the_mock_package() -> None:
    result = run_without_mock(
        """
        import pynvml

        import driver.plugin.main  # the gpu-kubelet-plugin entry point
        from driver.nvml.backend import NvmlBackend
        from driver.nvml.smi_timeslice import NvidiaSmiTimeSlice

        class NoGpus:
            # pynvml's errors and constants, a driver with no GPUs.
            def __getattr__(self, name):
                return getattr(pynvml, name)
            def nvmlInit(self): pass
            def nvmlShutdown(self): pass
            def nvmlSystemGetDriverVersion(self): return "580.95.05"
            def nvmlSystemGetCudaDriverVersion(self): return 13000
            def nvmlDeviceGetCount(self): return 0

        backend = NvmlBackend(NoGpus())
        assert backend.backend_name == "nvml", backend.backend_name
        assert backend.control_actions({}) == {}
        assert backend.event_wait_ms == 100
        assert backend.discover().gpus == ()
        assert isinstance(backend.timeslice("/run/nvidia/driver"), NvidiaSmiTimeSlice)
        loaded = [m for m in sys.modules if m.startswith(("driver.nvml.mock", "msgspec"))]
        assert not loaded, loaded
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_cli_loads_the_mock_only_for_its_mock_command() -> None:
    result = run_without_mock(
        """
        from driver.cli import build_parser

        args = build_parser().parse_args(["mock", "xid", "--device", "gpu-0", "--xid", "79"])
        assert args.mock_action == "xid"
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_blocker_does_refuse_the_mock() -> None:
    # Guards the test above: were the blocker broken, it would pass for nothing.
    result = run_without_mock("import driver.nvml.mock.nvml\n")
    assert result.returncode != 0
    assert "driver.nvml.mock is blocked" in result.stderr


# The plugin's whole start on real NVML (`gpu-kubelet-plugin --nvml-backend=nvml`), in
# a fresh interpreter: `main()` with the flags a node gives it, over the real pynvml
# module with its library calls answered as by a driver with no GPUs (there may be no
# GPU here), an API server that does not answer, and its directories in a temporary
# one. Once the status socket is served (the last thing the start binds, after the
# health monitor and the control actions are wired), the loaded modules are listed and
# the plugin is stopped as the kubelet stops it (SIGTERM).
START_PLUGIN = """
import json, os, signal, sys, threading, time
from pathlib import Path

import pynvml

TIMEOUT = pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
NO_GPUS = {
    "nvmlInit": lambda: None,
    "nvmlShutdown": lambda: None,
    "nvmlSystemGetDriverVersion": lambda: "580.95.05",
    "nvmlSystemGetCudaDriverVersion": lambda: 13000,
    "nvmlDeviceGetCount": lambda: 0,
    "nvmlEventSetCreate": lambda: object(),
    "nvmlEventSetFree": lambda event_set: None,
}

def wait(event_set, timeout_ms):
    time.sleep(timeout_ms / 1000)
    raise TIMEOUT

NO_GPUS["nvmlEventSetWait_v2"] = wait
for name, function in NO_GPUS.items():
    setattr(pynvml, name, function)

from driver.plugin.main import main

root = Path(sys.argv[1])
(root / "kubeconfig").write_text(json.dumps({
    "apiVersion": "v1", "kind": "Config", "current-context": "c",
    "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    "users": [{"name": "u", "user": {}}],
}))
hook = root / "nvidia-cdi-hook"
hook.write_text("#!/bin/sh\\n")
hook.chmod(0o755)
status_sock = root / "plugins" / "gpu.example.com" / "status.sock"
served, modules, control = [], [], []

def stop_once_served():
    deadline = time.monotonic() + 60
    while not status_sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    served.append(status_sock.exists())
    time.sleep(0.5)  # the health monitor's first event waits
    modules.extend(sorted(sys.modules))  # what the plugin loaded; then the CLI's client
    from driver.cli.plugin_endpoint import fetch_control

    control.append(fetch_control(status_sock)["actions"])
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=stop_once_served, daemon=True).start()
code = main([
    f"--nvml-backend={sys.argv[2]}",
    "--node-name=node-1",
    f"--kubeconfig={root / 'kubeconfig'}",
    f"--kubelet-plugins-directory-path={root / 'plugins'}",
    f"--kubelet-registrar-directory-path={root / 'registry'}",
    f"--cdi-root={root / 'cdi'}",
    f"--nvidia-cdi-hook-path={hook}",
    "--http-port=-1",
])
print(json.dumps({"code": code, "served": served, "modules": modules, "control": control}))
"""


def is_mock_module(name: str) -> bool:
    """A module of the mock backend: `driver.nvml.mock...`, or any of the driver's
    modules named after the mock (the mock's pieces kept elsewhere)."""
    parts = name.split(".")
    return parts[0] == "driver" and any("mock" in part for part in parts)


def start_plugin(root: Path, backend: str) -> tuple[list[str], list[str]]:
    """The modules `gpu-kubelet-plugin --nvml-backend=<backend>` loaded once serving,
    and the control actions its status socket accepts."""
    result = subprocess.run(
        [sys.executable, "-c", START_PLUGIN, str(root), backend],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["served"] == [True], result.stderr[-3000:]  # started all the way
    assert report["code"] == 0, result.stderr[-3000:]
    modules: list[str] = report["modules"]
    assert "driver.health.monitor" in modules
    assert "driver.observability.status_socket" in modules
    (actions,) = report["control"]
    return modules, actions


def test_the_plugin_started_on_real_nvml_loads_no_module_of_the_mock(short_dir: Path) -> None:
    modules, actions = start_plugin(short_dir, "nvml")
    loaded = [m for m in modules if is_mock_module(m)]
    assert not loaded, f"the real NVML backend's plugin loaded the mock's modules: {loaded}"
    assert actions == ["clear"]  # served on its status socket, without the mock's


def test_the_plugin_started_on_the_mock_does_load_it(short_dir: Path) -> None:
    # Guards the test above: the same start on the mock is seen to load the mock.
    modules, actions = start_plugin(short_dir, "mock")
    loaded = [m for m in modules if is_mock_module(m)]
    assert {"driver.nvml.mock.mock_backend", "driver.nvml.mock.mock_control"} <= set(loaded), loaded
    assert actions == ["clear", "lost", "process", "recovery-action", "reset", "xid"]
