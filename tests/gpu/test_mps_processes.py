"""MPS limits on a real GPU, for what one share's clients are and where they come from
(docs/mps.md, "What holds and what does not"): three processes of one share are each
held to the share's limits, and together pin more than one share's memory (the limits
are per process, not per claim); a client started after its daemon was killed and
started again by the plugin's start is limited (the new daemon serves the same pipe
directory, the same inode); a client running as uid 1000 reaches the daemon and is
limited; a `--gpu-partitions` partition whose memory is an odd number of MiB (a quarter
of an H100's 81559 MiB: 20389) is set and read back exactly.

Each client (tests/gpu/mps_clients.py) runs tests/gpu/cuda_bound.py in lock-step: its
bound is what its context reports free (its own context counts inside the pinned
limit), 64 MiB over it fails with CUDA_ERROR_OUT_OF_MEMORY and 64 MiB under it
succeeds. The compute mode is read before and after and must be unchanged; MIG mode is
never touched. Each test skips with one line where its condition is absent."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import DaemonId, MpsControl, is_running
from driver.state.mps.daemons import (
    NodeDaemons,
    daemon_dirs,
    pinned_limit_matches,
    unsearchable_parent,
)
from tests.gpu.bound_clients import Allocation, Client, context_memory, finish, reach, release
from tests.gpu.cuda_bound import HOLDING, READY
from tests.gpu.mps_clients import (
    BOUND,
    MARGIN_MIB,
    Share,
    as_uid,
    node_daemons,
    python,
    record,
    start,
    stop,
)
from tests.gpu.mps_gate import compute_mode, require_mps
from tests.gpu.mps_shares import MpsShare
from tests.gpu.node import open_node

ROOT = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
LIMIT_MIB = 2048
THREADS = 50
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
TENANT_UID = 1000
PARTITION_COUNTS = (4, 3, 5, 6, 7, 8)  # the first whose partition is not whole GiB


def _bounded(clients: list[Client], limit_mib: int) -> list[int]:
    """Run the clients in lock-step to the end; each one's bound (MiB its context
    reported free), checked under `limit_mib`, its allocation over the bound refused
    and the one under it made."""
    reach(clients, READY)
    bounds = [context_memory(c.lines)[0] for c in clients]
    for client, free in zip(clients, bounds, strict=True):
        assert 0 < free < limit_mib, f"{client.name}: {free} MiB free:\n{client.said()}"
    release(clients)
    reach(clients, HOLDING)
    return bounds


def _finished(clients: list[Client], bounds: list[int]) -> None:
    release(clients)
    assert finish(clients) == [0] * len(clients), "\n".join(c.said() for c in clients)
    for client, free in zip(clients, bounds, strict=True):
        report = client.report()
        print(f"{client.name}: free {free} MiB, sm {report.context_sms}/{report.device_sms}")
        assert report.over == Allocation(free + MARGIN_MIB, CUDA_ERROR_OUT_OF_MEMORY)
        assert report.under == Allocation(free - MARGIN_MIB, CUDA_SUCCESS)


def _pids(answer: str) -> list[int]:
    return [int(word) for word in answer.split() if word.isdigit()]


def test_three_processes_of_one_share_are_each_held_to_its_limits(
    whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    mode = require_mps(ROOT, whole_gpu.uuid)
    control = MpsControl(ROOT)
    share = Share("three", THREADS, LIMIT_MIB)
    with node_daemons(control, tmp_path / "mps", whole_gpu.uuid, [share]) as (mps, daemons):
        (daemon,) = daemons
        pipe = daemon.pipe(mps)
        clients = [
            start(f"process-{i}", pipe, whole_gpu.uuid, namespace_of=daemon.record.pid)
            for i in range(3)
        ]
        try:
            bounds = _bounded(clients, LIMIT_MIB)
            dirs = daemon_dirs(mps.root, daemon.record)
            servers = _pids(control.command(dirs, "get_server_list"))
            assert len(servers) == 1, f"one uid, one MPS server: {servers}"
            listed = _pids(control.command(dirs, f"get_client_list {servers[0]}"))
            print(f"server {servers[0]} clients {listed}; ours {[c.proc.pid for c in clients]}")
            assert len(listed) == 3, listed
            _finished(clients, bounds)
        finally:
            stop(clients)
    reports = [c.report() for c in clients]
    held = sum(r.under.mib for r in reports)
    record("three_processes_held_mib", held)
    # Per process, not per claim: together they held more than the share's limit.
    assert held > LIMIT_MIB
    # Each may use the share's whole SM percentage: the same SM count in each context.
    contexts = {r.context_sms for r in reports}
    record("three_processes_context_sms", "/".join(sorted(contexts)))
    if all(c.isdigit() for c in contexts):
        assert len(contexts) == 1 and int(next(iter(contexts))) < reports[0].device_sms
    assert compute_mode(whole_gpu.uuid) == mode


def test_a_client_started_after_its_daemon_was_killed_and_revived_is_limited(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    mode = require_mps(ROOT, whole_gpu.uuid)
    control = MpsControl(ROOT)
    node = open_node(backend, tmp_path, mps_daemons=NodeDaemons(control))
    uid = "revived"
    parameters = MpsShare(uid, LIMIT_MIB, THREADS).parameters()
    ref = node.claims.add_configured(uid, f"gpu-{whole_gpu.minor}", parameters)
    clients: list[Client] = []
    try:
        result = node.state.prepare([ref])[uid]
        assert result.ok, result.error
        (device,) = node.state.checkpoint.load()[uid].devices
        assert device.mps is not None
        dirs = daemon_dirs(node.state.mps.root, device.mps)
        inode = dirs.pipe.stat().st_ino
        killed = DaemonId(device.mps.pid, device.mps.start_time)
        os.kill(killed.pid, signal.SIGKILL)
        give_up = time.monotonic() + 30
        while is_running(killed) and time.monotonic() < give_up:
            time.sleep(0.05)
        assert not is_running(killed)
        # The plugin's start: recovery finds the daemon gone and starts it again.
        node = open_node(backend, tmp_path, mps_daemons=NodeDaemons(control))
        assert uid in node.recovered.mps_lost, node.recovered
        (revived,) = node.state.checkpoint.load()[uid].devices
        assert revived.mps is not None and revived.mps.pid != killed.pid
        assert is_running(DaemonId(revived.mps.pid, revived.mps.start_time))
        assert dirs.pipe.stat().st_ino == inode, "a new pipe directory: containers lose MPS"
        clients.append(
            start("after-revival", dirs.pipe, whole_gpu.uuid, namespace_of=revived.mps.pid)
        )
        bounds = _bounded(clients, LIMIT_MIB)
        _finished(clients, bounds)
        record("revived_daemon_client_free_mib", bounds[0])
    finally:
        stop(clients)
        released = node.state.unprepare([ref])
    assert released == {uid: None}
    assert control.running(dirs) is None
    assert compute_mode(whole_gpu.uuid) == mode


def _open_to_others(path: Path) -> bool:
    return path.exists() and stat.S_IMODE(path.stat().st_mode) & 0o006 == 0o006


def test_a_client_of_uid_1000_reaches_the_daemon_and_is_limited(whole_gpu: GpuInfo) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"uid-{TENANT_UID} client: starting a process as another uid needs root")
    mode = require_mps(ROOT, whole_gpu.uuid)
    nodes = [Path("/dev/nvidiactl"), Path(f"/dev/nvidia{whole_gpu.minor}")]
    closed = [str(n) for n in nodes if not _open_to_others(n)]
    if closed:
        pytest.skip(f"uid-{TENANT_UID} client: {', '.join(closed)} not open to other users")
    # Not under the test's own temporary directory (0700): the uid's MPS server opens
    # the pipe directory by this path, and the client runs a copy of the script.
    base = Path(tempfile.mkdtemp(prefix="gpu-dra-tier-uid-", dir="/tmp"))
    try:
        base.chmod(0o711)
        script = base / BOUND.name
        shutil.copy(BOUND, script)
        script.chmod(0o644)
        blocked = unsearchable_parent(base / "mps")
        if blocked is not None:
            pytest.skip(f"uid-{TENANT_UID} client: {blocked} is not searchable by other users")
        probe = subprocess.run(
            as_uid(TENANT_UID, [python(), "-S", "-c", "import ctypes"]),
            capture_output=True,
            text=True,
            check=False,
        )
        if probe.returncode != 0:
            pytest.skip(f"uid-{TENANT_UID} client: cannot run Python as it: {probe.stderr.strip()}")
        control = MpsControl(ROOT)
        share = Share("uid1000", THREADS, LIMIT_MIB)
        with node_daemons(control, base / "mps", whole_gpu.uuid, [share]) as (mps, daemons):
            (daemon,) = daemons
            pipe = daemon.pipe(mps)
            client = start(
                f"uid-{TENANT_UID}",
                pipe,
                whole_gpu.uuid,
                namespace_of=daemon.record.pid,
                script=script,
                uid=TENANT_UID,
            )
            try:
                bounds = _bounded([client], LIMIT_MIB)
                dirs = daemon_dirs(mps.root, daemon.record)
                servers = _pids(control.command(dirs, "get_server_list"))
                uids = [_uid_of(pid) for pid in servers]
                print(f"MPS servers {servers}, uids {uids}")
                assert TENANT_UID in uids, f"no MPS server of uid {TENANT_UID}: {uids}"
                _finished([client], bounds)
            finally:
                stop([client])
        record("uid_1000_client_free_mib", bounds[0])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert compute_mode(whole_gpu.uuid) == mode


def _uid_of(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def test_a_partition_of_an_odd_number_of_mib_is_read_back_exactly(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    mode = require_mps(ROOT, whole_gpu.uuid)
    if whole_gpu.memory_bytes is None:
        pytest.skip(f"odd partition: NVML reports no memory for GPU {whole_gpu.uuid}")
    memory = whole_gpu.memory_bytes
    count = next((n for n in PARTITION_COUNTS if (memory // n >> 20) % 1024), None)
    if count is None:
        pytest.skip(f"odd partition: {memory >> 20} MiB / {PARTITION_COUNTS} is whole GiB each")
    expected_mib = memory // count >> 20
    control = MpsControl(ROOT)
    node = open_node(backend, tmp_path, mps_daemons=NodeDaemons(control), gpu_partitions=count)
    uid = "odd"
    ref = node.claims.add(uid, f"gpu-{whole_gpu.minor}-partition-0")
    clients: list[Client] = []
    try:
        result = node.state.prepare([ref])[uid]  # sets the limit and reads it back
        assert result.ok, result.error
        (device,) = node.state.checkpoint.load()[uid].devices
        assert device.mps is not None and device.mps.pinned_memory_bytes is not None
        assert device.mps.pinned_memory_bytes == expected_mib << 20
        dirs = daemon_dirs(node.state.mps.root, device.mps)
        answer = control.command(dirs, "get_default_device_pinned_mem_limit 0")
        record("odd_partition", f"{count} partitions of {memory >> 20} MiB: {expected_mib} MiB")
        record("odd_partition_readback", repr(answer))
        assert pinned_limit_matches(answer, device.mps.pinned_memory_bytes), answer
        clients.append(start("partition", dirs.pipe, whole_gpu.uuid, namespace_of=device.mps.pid))
        bounds = _bounded(clients, expected_mib)
        assert expected_mib - bounds[0] < 1024, "the context takes a few hundred MiB, not GiB"
        _finished(clients, bounds)
    finally:
        stop(clients)
        released = node.state.unprepare([ref])
    assert released == {uid: None}
    assert compute_mode(whole_gpu.uuid) == mode
