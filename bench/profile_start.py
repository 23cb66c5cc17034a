"""The plugin's start → registered time and its RSS, without a control plane:
`python -m bench.profile_start [--starts N] [--gpus FLEET] [--cycles N]`.

Each start is a fresh `gpu-kubelet-plugin` process on the mock NVML (by default the
bench's 64 `example` GPUs; `--gpus default` for the 8 H100 with MIG, or a fleet file),
in directories of its own, started from compiled bytecode as `bench.plugins.OursPlugin`
starts it. "Registered" is what `bench.scenarios.start_and_publish` times: from the
spawn to the moment the kubelet stand-in (polling every 5 ms) has called GetInfo and
NotifyRegistrationStatus on the plugin's registration socket. The API server is the
canned one of `bench.profile_call` (every GET answers one allocated claim; writes
fail), so the start path's API round trips are local and cheap.

After registration each start runs `--cycles` prepare/unprepare cycles of that claim
(the warm-up of the bench's RSS row), then reads the plugin's VmRSS. Printed: p50 /
p99 of start → registered over the starts, and p50 of RSS after registration and
after the warm-up, and the p50 of the CPU time (user + system, all threads) the
plugin had used when it was registered: on a busy machine that one moves less than
the wall clock. The first start compiles the bytecode and is not counted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.canned_api import canned_claim, start_canned_api
from bench.scenarios import percentile
from tests.integration.kubelet_standin import ClaimRef, KubeletStandin
from tests.integration.plugin_process import DRIVER, free_port, plugin_command

NODE = "profile-start-node"
NS = "default"
CLAIM = ClaimRef(NS, "0a0a0a0a-0000-4000-8000-0000000000a1", "profile-start")


@dataclass(frozen=True)
class StartSample:
    registered_s: float
    cpu_registered_s: float
    rss_registered_mib: float
    rss_warm_mib: float


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def fleet_arg(gpus: str, work: Path) -> str:
    if gpus != "example-64":
        return gpus
    fleet = work / "example-64.yaml"
    fleet.write_text("gpus:\n  - model: example\n    count: 64\n")
    return str(fleet)


def one_start(work: Path, kubeconfig: Path, fleet: str, pycache: Path, cycles: int) -> StartSample:
    root = Path(tempfile.mkdtemp(prefix="gps-", dir="/tmp"))  # socket paths stay short
    registry = root / "plugins_registry"
    kubelet = KubeletStandin(registry, poll_interval=0.005).start()
    cmd = plugin_command(
        node_name=NODE,
        kubeconfig=kubeconfig,
        registry_dir=registry,
        plugins_dir=root / "plugins",
        cdi_root=root / "cdi",
        http_port=free_port(),
        extra=[f"--mock-fleet={fleet}"],
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(pycache)}
    with (work / "plugin.log").open("ab") as log:
        spawned = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        registered = kubelet.wait_for_plugin(DRIVER, timeout=60).registered_at - spawned
        cpu_registered = cpu_seconds(proc.pid)
        rss_registered = rss_mib(proc.pid)
        for _ in range(cycles):
            for what, call in (("prepare", kubelet.prepare), ("unprepare", kubelet.unprepare)):
                if error := call(DRIVER, [CLAIM])[CLAIM.uid].error:
                    raise RuntimeError(f"{what}: {error}")
        return StartSample(registered, cpu_registered, rss_registered, rss_mib(proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--gpus", default="example-64", help="example-64, default or a file")
    parser.add_argument("--cycles", type=int, default=20, help="prepare/unprepare per start")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="profile-start-"))
    try:
        kubeconfig = start_canned_api(canned_claim(NS, CLAIM.name, CLAIM.uid, NODE), work)
        fleet = fleet_arg(args.gpus, work)
        pycache = work / "pycache"
        one_start(work, kubeconfig, fleet, pycache, 0)  # compiles the bytecode
        samples = [
            one_start(work, kubeconfig, fleet, pycache, args.cycles) for _ in range(args.starts)
        ]
    except Exception:
        print((work / "plugin.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    times = sorted(s.registered_s for s in samples)
    print(f"starts: {len(samples)}, fleet {args.gpus}, {args.cycles} prepare cycles each")
    print(
        f"start -> registered: p50 {percentile(times, 50) * 1e3:.0f} ms, "
        f"p99 {percentile(times, 99) * 1e3:.0f} ms"
    )
    cpu = sorted(s.cpu_registered_s for s in samples)
    print(f"CPU time at registered: p50 {percentile(cpu, 50) * 1e3:.0f} ms")
    print(
        f"RSS: registered {statistics.median(s.rss_registered_mib for s in samples):.1f} MiB, "
        f"after warm-up {statistics.median(s.rss_warm_mib for s in samples):.1f} MiB"
    )


if __name__ == "__main__":
    main()
