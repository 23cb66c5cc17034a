"""Host CUDA clients for the MPS tests of the real-GPU tier, started as a container with
a claim's CDI edits would be: `CUDA_MPS_PIPE_DIRECTORY` at the daemon's pipe directory
(or at another one, to leave MPS), the GPU in `CUDA_VISIBLE_DEVICES`, in the daemon's
mount namespace (`nsenter`: its `/dev/shm`, which the claim's containers mount too),
optionally as another uid. Each runs a standard-library script with `python -S`
(tests/gpu/cuda_bound.py in lock-step through tests/gpu/bound_clients.py, or
tests/gpu/cuda_busy.py), so that a uid without access to the repository or a venv
can run a copy of it.

`node_daemons` starts MPS control daemons as the plugin's `--mps-daemons=node` does
(driver/state/mps/claim_daemons.py), one per share, and stops them at its end,
checking that none is left."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from driver.nvml.mps import MpsControl
from driver.state.journal.checkpoint import PreparedDevice
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.claim_daemons import ClaimMps
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from tests.gpu.bound_clients import Client

HERE = Path(__file__).resolve().parent
BOUND = HERE / "cuda_bound.py"
BUSY = HERE / "cuda_busy.py"
MIB = 1 << 20
MARGIN_MIB = 64


def python() -> str:
    """The interpreter running the tests, by its real path (a venv's link would lead
    another uid through directories it may not search)."""
    return os.path.realpath(sys.executable)


@dataclass(frozen=True)
class Share:
    """A share's MPS limits: active-thread percentage, pinned memory in MiB."""

    name: str
    threads: int | None
    memory_mib: int | None


@dataclass(frozen=True)
class Daemon:
    """A running daemon of `node_daemons`: its prepared device (the journal's record
    with its pid) and its pipe directory."""

    share: Share
    device: PreparedDevice

    @property
    def record(self) -> MpsRecord:
        assert self.device.mps is not None
        return self.device.mps

    def pipe(self, mps: ClaimMps) -> Path:
        return daemon_dirs(mps.root, self.record).pipe


@contextmanager
def node_daemons(
    control: MpsControl, root: Path, gpu_uuid: str, shares: Sequence[Share]
) -> Iterator[tuple[ClaimMps, list[Daemon]]]:
    """A daemon per share for the GPU, under the MPS root `root`, as prepare starts
    them (limits set and read back); all stopped at the end, and checked gone."""
    mps = ClaimMps(NodeDaemons(control), root)
    devices = []
    for i, share in enumerate(shares):
        memory = None if share.memory_mib is None else share.memory_mib * MIB
        record = MpsRecord(gpu_uuid, f"claim-{share.name}", share.threads, memory)
        cdi = (f"k8s.x/gpu=claim-{share.name}",)
        devices.append(PreparedDevice(f"claim-{share.name}", f"gpu-{i}", ("r0",), cdi, mps=record))
    started = list(mps.apply("gpu-tier", devices, {}))
    try:
        yield mps, [Daemon(s, d) for s, d in zip(shares, started, strict=True)]
    finally:
        mps.restore("gpu-tier", started, {})
        for device in started:
            assert device.mps is not None
            assert control.running(daemon_dirs(mps.root, device.mps)) is None


def client_env(pipe: Path, gpu_uuid: str) -> dict[str, str]:
    return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_VISIBLE_DEVICES": gpu_uuid}


def as_uid(uid: int, command: Sequence[str]) -> list[str]:
    """`command` run as `uid`, with its own gid and no supplementary groups."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *command]


def argv(
    script: Path, args: Sequence[str], *, namespace_of: int | None, uid: int | None = None
) -> list[str]:
    """`python -S -u script args`, in the mount namespace of process `namespace_of`
    (None: the test's own) and as `uid` (and its own gid, no supplementary groups)."""
    run = [python(), "-S", "-u", str(script), *args]
    if uid is not None:
        run = as_uid(uid, run)
    if namespace_of is not None:
        run = ["nsenter", f"--mount=/proc/{namespace_of}/ns/mnt", "--", *run]
    return run


def start(
    name: str,
    pipe: Path,
    gpu_uuid: str,
    *,
    namespace_of: int | None,
    script: Path = BOUND,
    args: Sequence[str] = (str(MARGIN_MIB),),
    uid: int | None = None,
) -> Client:
    """A client process read in lock-step (`Client`): its stdout and stderr merged."""
    proc = subprocess.Popen(
        argv(script, args, namespace_of=namespace_of, uid=uid),
        env=client_env(pipe, gpu_uuid),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Client(name, proc)


def stop(clients: Sequence[Client]) -> None:
    """Each client's stdin closed (a waiting client ends), then waited for; killed
    after 20 s."""
    for client in clients:
        if client.proc.stdin is not None and not client.proc.stdin.closed:
            with suppress(OSError):
                client.proc.stdin.close()
    for client in clients:
        try:
            client.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            client.proc.kill()
            client.proc.wait()


def record(key: str, value: object) -> None:
    """A number the run keeps (hack/gpu-tier-mps.sh copies these lines, printed with
    `-s`, into its results file)."""
    print(f"RECORD {key}={value}", flush=True)
