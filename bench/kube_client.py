"""The plugin's import time, start, prepare latency and RSS, per source tree, side by
side: how much a Kubernetes client costs the plugin (issue 43, item 4).

    python -m bench.kube_client --tree LABEL=DIR [--tree LABEL=DIR ...] \\
        [--rounds 5] [--starts 2] [--cycles 200] [--out FILE]

Each `--tree` is a checkout whose `driver` package the plugin runs (the harness, the
canned API server and the kubelet stand-in are this checkout's). Per round every tree
gets its turn, the order reversed every other round, so that the machine's load hits
all of them alike. A turn is:

- `--imports` fresh interpreters that import `driver.plugin.main` (its modules, from
  compiled bytecode), each reporting the import's wall and CPU time, its RSS after the
  import and the number of modules loaded;
- `--starts` plugin starts as `bench.profile_start` makes them (64 `example` GPUs on the
  mock NVML, the canned API server of `bench.profile_call`: plain HTTP, keep-alive, no
  credentials), each timing spawn → registered (and the plugin's CPU time by then:
  on a busy machine that moves less than the wall clock), reading VmRSS then, and after
  `--warm-up` prepare/unprepare cycles that are not timed, `--cycles` timed ones (the
  kubelet stand-in's wall clock around each NodePrepareResources call), then VmRSS
  again.

Every tree's bytecode is compiled by one start before the first round (not counted).
The results (`--out`) keep every sample; `bench.kube_client_report` makes the tables.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.canned_api import canned_claim, start_canned_api
from bench.profile_start import CLAIM, NODE, NS, cpu_seconds, fleet_arg, rss_mib
from tests.integration.kubelet_standin import KubeletStandin
from tests.integration.plugin_process import DRIVER, free_port, plugin_command

IMPORT_PROBE = """
import sys, time
began, cpu = time.perf_counter(), time.process_time()
import driver.plugin.main
took, cpu = time.perf_counter() - began, time.process_time() - cpu
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
print(took, cpu, rss / 1024, len(sys.modules))
"""
CLIENT_MODULES = ("driver/kube/connection.py", "driver/kube/api.py")


@dataclass(frozen=True)
class Tree:
    label: str
    path: Path


@dataclass
class Turn:
    tree: str
    round: int
    import_s: list[float] = field(default_factory=list)
    import_cpu_s: list[float] = field(default_factory=list)
    import_rss_mib: list[float] = field(default_factory=list)
    import_modules: list[int] = field(default_factory=list)
    registered_s: list[float] = field(default_factory=list)
    cpu_registered_s: list[float] = field(default_factory=list)
    rss_registered_mib: list[float] = field(default_factory=list)
    rss_after_cycles_mib: list[float] = field(default_factory=list)
    prepare_s: list[list[float]] = field(default_factory=list)  # one list per start
    load_1m: float = 0.0


def tree_env(tree: Tree, pycache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(tree.path),
        "PYTHONDONTWRITEBYTECODE": "",
        "PYTHONPYCACHEPREFIX": str(pycache / tree.label),
    }


def measure_import(tree: Tree, pycache: Path, turn: Turn) -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE],
        cwd=tree.path,
        env=tree_env(tree, pycache),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    turn.import_s.append(float(out[0]))
    turn.import_cpu_s.append(float(out[1]))
    turn.import_rss_mib.append(float(out[2]))
    turn.import_modules.append(int(out[3]))


@dataclass(frozen=True)
class Setup:
    """What every start shares: the work directory, the canned API's kubeconfig, the
    fleet file and the per-tree bytecode caches."""

    work: Path
    kubeconfig: Path
    fleet: str
    pycache: Path


def measure_start(tree: Tree, setup: Setup, warm_up: int, cycles: int, turn: Turn) -> None:
    root = Path(tempfile.mkdtemp(prefix="kc-", dir="/tmp"))  # socket paths stay short
    registry = root / "plugins_registry"
    kubelet = KubeletStandin(registry, poll_interval=0.005).start()
    cmd = plugin_command(
        node_name=NODE,
        kubeconfig=setup.kubeconfig,
        registry_dir=registry,
        plugins_dir=root / "plugins",
        cdi_root=root / "cdi",
        http_port=free_port(),
        extra=[f"--mock-fleet={setup.fleet}"],
    )
    env = tree_env(tree, setup.pycache)
    with (setup.work / f"plugin-{tree.label}.log").open("ab") as log:
        spawned = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=tree.path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        turn.registered_s.append(
            kubelet.wait_for_plugin(DRIVER, timeout=60).registered_at - spawned
        )
        turn.cpu_registered_s.append(cpu_seconds(proc.pid))
        turn.rss_registered_mib.append(rss_mib(proc.pid))
        timed = []
        for cycle in range(warm_up + cycles):
            began = time.monotonic()
            if error := kubelet.prepare(DRIVER, [CLAIM])[CLAIM.uid].error:
                raise RuntimeError(f"prepare: {error}")
            if cycle >= warm_up:
                timed.append(time.monotonic() - began)
            if error := kubelet.unprepare(DRIVER, [CLAIM])[CLAIM.uid].error:
                raise RuntimeError(f"unprepare: {error}")
        turn.rss_after_cycles_mib.append(rss_mib(proc.pid))
        turn.prepare_s.append(timed)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def describe(tree: Tree) -> dict[str, Any]:
    """The tree's commit and changed files where it is a git checkout, and the sha256
    of its API client's modules either way."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=tree.path, capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD"),
        "changed": git("status", "--short", "--untracked-files=no").splitlines(),
        "sha256": {
            name: hashlib.sha256((tree.path / name).read_bytes()).hexdigest()
            for name in CLIENT_MODULES
        },
    }


def _tree(text: str) -> Tree:
    label, _, path = text.partition("=")
    if not label or not path:
        raise argparse.ArgumentTypeError("--tree takes LABEL=DIR")
    return Tree(label, Path(path).resolve())


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kube_client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tree", type=_tree, action="append", required=True, metavar="LABEL=DIR")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--imports", type=int, default=3, help="import probes per turn")
    parser.add_argument("--starts", type=int, default=2, help="plugin starts per turn")
    parser.add_argument("--warm-up", type=int, default=5, help="untimed cycles per start")
    parser.add_argument("--cycles", type=int, default=200, help="timed cycles per start")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = dt.datetime.now(dt.UTC)
    work = Path(tempfile.mkdtemp(prefix="kube-client-"))
    turns: list[Turn] = []
    try:
        kubeconfig = start_canned_api(canned_claim(NS, CLAIM.name, CLAIM.uid, NODE), work)
        setup = Setup(work, kubeconfig, fleet_arg("example-64", work), work / "pycache")
        for tree in args.tree:  # compiles the bytecode
            measure_start(tree, setup, 0, 0, Turn(tree.label, -1))
        for index in range(args.rounds):
            order = args.tree if index % 2 == 0 else args.tree[::-1]
            for tree in order:
                turn = Turn(tree.label, index, load_1m=os.getloadavg()[0])
                for _ in range(args.imports):
                    measure_import(tree, setup.pycache, turn)
                for _ in range(args.starts):
                    measure_start(tree, setup, args.warm_up, args.cycles, turn)
                turns.append(turn)
                print(_line(turn), flush=True)
    except Exception:
        for log in sorted(work.glob("plugin-*.log")):
            print(log.name, log.read_text(errors="replace")[-3000:])
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        command = ["python -m bench.kube_client"]
        command += [f"--tree {t.label}=<{t.label} tree>" for t in args.tree]
        command += [f"--rounds {args.rounds} --imports {args.imports} --starts {args.starts}"]
        command += [f"--warm-up {args.warm_up} --cycles {args.cycles} --out {args.out}"]
        document = {
            "command": " ".join(command),
            "started": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "finished": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python "
            f"{platform.python_version()}; plugin, API stand-in and kubelet stand-in on "
            "the same CPUs",
            "trees": {t.label: describe(t) for t in args.tree},
            "turns": [asdict(t) for t in turns],
        }
        args.out.write_text(json.dumps(document, indent=1) + "\n")


def _line(turn: Turn) -> str:
    pooled = sorted(s for start in turn.prepare_s for s in start)
    p50 = pooled[len(pooled) // 2] * 1e3 if pooled else float("nan")
    return (
        f"round {turn.round} {turn.tree}: import {min(turn.import_s) * 1e3:.0f} ms "
        f"(CPU {min(turn.import_cpu_s) * 1e3:.0f}) "
        f"{max(turn.import_rss_mib):.1f} MiB {max(turn.import_modules)} modules; registered "
        f"{min(turn.registered_s) * 1e3:.0f} ms; prepare p50 {p50:.2f} ms; RSS "
        f"{max(turn.rss_registered_mib):.1f} -> {max(turn.rss_after_cycles_mib):.1f} MiB "
        f"(load {turn.load_1m:.2f})"
    )


if __name__ == "__main__":
    main()
