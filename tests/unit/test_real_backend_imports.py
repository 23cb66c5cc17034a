"""The real NVML path never loads the mock.

A plugin on a GPU node runs `select_backend(mock=False)`: the mock package (and msgspec,
which only the mock's fleet files need) must not be imported there, so a node image or
bundle without them works and no fake device code sits in a production process. The
check runs in a fresh interpreter in which `driver.nvml.mock` and `msgspec` cannot be
imported at all.
"""

from __future__ import annotations

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
        from driver.nvml.timeslice import NvidiaSmiTimeSlice

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
        assert backend.mock_module is None
        assert backend.discover().gpus == ()
        assert isinstance(backend.timeslice("/run/nvidia/driver"), NvidiaSmiTimeSlice)
        loaded = [m for m in sys.modules if m.startswith(("driver.nvml.mock", "msgspec"))]
        assert not loaded, loaded
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_blocker_does_refuse_the_mock() -> None:
    # Guards the test above: were the blocker broken, it would pass for nothing.
    result = run_without_mock("import driver.nvml.mock.nvml\n")
    assert result.returncode != 0
    assert "driver.nvml.mock is blocked" in result.stderr
