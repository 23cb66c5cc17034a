"""Strict partitions on a real GPU with MIG off (docs/mps.md, "Strict partitions: one
server per GPU"): two claims on the two `--gpu-partitions 2` partitions of one GPU,
prepared by the driver's code with `--mps-strict-partitions` (tests/gpu/node.py, node
MPS daemons of the driver root's nvidia-cuda-mps-control):

- one control daemon serves both claims, started with `-d -M` (multi-user), and
  holds the partition's limits; NVML reads the GPU's mode EXCLUSIVE_PROCESS;
- a client of each claim (tests/gpu/cuda_alloc.py in the daemon's mount namespace,
  each with its claim's CUDA_MPS_* variables) holds a context at the same time;
- a CUDA process outside MPS fails to create one while their server runs;
- unpreparing the first claim keeps the daemon and the mode; unpreparing the second
  stops the daemon and puts back the mode NVML read before.

The mode found is put back whatever fails on the way; MIG mode is never touched.
Without the driver root's nvidia-cuda-mps-control, or where the GPU's partitions are
not strict (before Volta), this test skips with one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from driver.devices.model import MPS_ISOLATION_ATTRIBUTE, MPS_ISOLATION_STRICT
from driver.nvml.backend import NvmlBackend
from driver.nvml.compute_mode import COMPUTE_MODE_EXCLUSIVE_PROCESS, mode_name
from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import MpsControl, find_binary
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from tests.gpu.mps_shares import MpsShare
from tests.gpu.node import open_node
from tests.gpu.test_mps_strict import ROOT, _cuda

LIMIT_MIB = 2048
THREADS = 25


def test_a_gpus_partition_claims_share_one_multi_user_server(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    uuid = whole_gpu.uuid
    if find_binary(ROOT) is None:
        pytest.skip(f"no nvidia-cuda-mps-control under the driver root {ROOT}")
    modes = backend.compute_modes()
    found = modes.get(uuid)
    node = open_node(
        backend,
        tmp_path,
        mps_daemons=NodeDaemons(MpsControl(ROOT)),
        gpu_partitions=2,
        mps_strict_partitions=True,
    )
    strict = sorted(
        d.name
        for d in node.pool.devices_of_gpu(uuid)
        if d.is_partition
        and d.document["attributes"].get(MPS_ISOLATION_ATTRIBUTE)
        == {"string": MPS_ISOLATION_STRICT}
    )
    if len(strict) != 2:
        pytest.skip(f'the partitions of GPU {uuid} are not "strict" (before Volta?): {strict}')
    refs = [
        node.claims.add_configured(uid, device, MpsShare(uid, LIMIT_MIB, THREADS).parameters())
        for uid, device in zip(("part-a", "part-b"), strict, strict=True)
    ]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    clients: list[subprocess.Popen[str]] = []
    unprepared: dict[str, object] = {}
    left = found
    try:
        results = node.state.prepare(refs)
        assert all(r.ok for r in results.values()), results
        assert modes.get(uuid) == COMPUTE_MODE_EXCLUSIVE_PROCESS
        journal = node.state.checkpoint.load()
        records = [journal[r.uid].devices[0].mps for r in refs]
        assert all(r is not None and r.shared for r in records), records
        assert len({(r.pid, r.directory) for r in records if r is not None}) == 1, records
        daemon = records[0]
        assert daemon is not None
        cmdline = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().split(b"\0")
        print(f"the GPU's daemon: pid {daemon.pid}, {cmdline!r}")
        assert b"-M" in cmdline, cmdline
        pipe = daemon_dirs(node.state.mps.root, daemon).pipe
        for _ in refs:
            client = _cuda(uuid, pipe, namespace_of=daemon.pid, hold=True)
            clients.append(client)
            assert client.stdout is not None
            said = [client.stdout.readline() for _ in range(2)]
            print(f"MPS client: {said!r}")
            assert said[-1].strip() == "allocated", said
        outside = _cuda(uuid, elsewhere, namespace_of=None, hold=False)
        out, _ = outside.communicate(timeout=120)
        print(f"outside MPS: exit {outside.returncode}: {out.strip()!r}")
        assert outside.returncode == 4 and "allocated" not in out, out
        for client in clients:
            client.communicate(timeout=120)
            assert client.returncode == 0
        clients.clear()
        assert node.state.unprepare(refs[:1]) == {"part-a": None}
        assert modes.get(uuid) == COMPUTE_MODE_EXCLUSIVE_PROCESS  # part-b still prepared
        assert Path(f"/proc/{daemon.pid}").exists()
    finally:
        for client in clients:
            client.kill()
            client.wait()
        unprepared = dict(node.state.unprepare(refs[1:]))
        left = modes.get(uuid)
        if left != found:
            modes.set(uuid, found)
    assert unprepared == {"part-b": None}
    assert left == found, f"the last unprepare left GPU {uuid} in {mode_name(left)}"
