"""Two claims' MPS shares of one GPU through tests/gpu/mps_shares.py and the tier's node
(tests/gpu/node.py) on the mock, with the mock's MPS stand-in as `--mps-daemons=node`
runs it: what tests/gpu/test_mps_containers.py prepares on a real GPU. Each share gets
a daemon of its own holding its own limits, and a CDI device whose edits (as
tests/cdi_bundle.py resolves them for a container) carry its limits and its own pipe
directory; unprepare stops both daemons and removes their directories."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml.mps import DaemonId, MpsControl, is_running
from tests import cdi_bundle
from tests.gpu.mps_shares import (
    MpsShare,
    PreparedShare,
    mock_share_node,
    prepare_shares,
    unprepare_shares,
)
from tests.gpu.node import GpuNode

SHARES = (MpsShare("small", 2048, 25), MpsShare("large", 4096, 50))


@pytest.fixture
def node_and_control(tmp_path: Path) -> Iterator[tuple[GpuNode, MpsControl]]:
    node, control = mock_share_node(tmp_path)
    yield node, control
    for pid_file in (tmp_path / "plugin" / "mps").glob("*/pipe/*.pid"):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # a failed test leaves none


def _daemon(prepared: PreparedShare) -> DaemonId:
    return DaemonId(prepared.record.pid, prepared.record.start_time)


def test_two_shares_of_one_gpu_get_their_own_daemons_limits_and_edits(
    node_and_control: tuple[GpuNode, MpsControl],
) -> None:
    node, control = node_and_control
    gpu = node.backend.discover().gpus[0]
    prepared = prepare_shares(node, f"gpu-{gpu.minor}", SHARES)
    small, large = prepared
    assert {p.record.gpu_uuid for p in prepared} == {gpu.uuid}
    assert small.directory != large.directory and small.record.pid != large.record.pid
    assert all(is_running(_daemon(p)) for p in prepared)
    common = json.loads(node.state.cdi.common_spec_path.read_text())
    for p in prepared:
        limit = f"{p.share.memory_mib}M"
        assert control.command(p.dirs, "get_default_device_pinned_mem_limit 0") == limit
        assert control.command(p.dirs, "get_default_active_thread_percentage") == (
            f"{p.share.threads}.0"
        )
        assert [i.split("=")[1] for i in p.cdi_devices] == [
            f"{p.share.uid}-gpu-{gpu.minor}-share-{p.share.uid}",
            "common",
        ]
        edits = cdi_bundle.edits_for([node.spec(p.share.uid), common], p.cdi_devices)
        env = {line for e in edits for line in e.get("env", [])}
        assert {
            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={limit}",
            f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={p.share.threads}",
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        } <= env
        mounts = [m for e in edits for m in e.get("mounts", [])]
        assert [m["hostPath"] for m in mounts if m["containerPath"] == "/tmp/nvidia-mps"] == [
            str(p.dirs.pipe)
        ]
    assert [p.share.consumed() for p in prepared] == [
        {"memory": "2Gi", "compute": "25"},
        {"memory": "4Gi", "compute": "50"},
    ]

    unprepare_shares(node, prepared)
    assert not any(is_running(_daemon(p)) for p in prepared)
    assert not any(p.directory.exists() for p in prepared)


def test_a_refused_prepare_names_its_claim(node_and_control: tuple[GpuNode, MpsControl]) -> None:
    node, _ = node_and_control
    refused = MpsShare("bad", 2048, 0)  # 0 %: the config's one-line error
    with pytest.raises(AssertionError, match=r"claim bad: .*defaultActiveThreadPercentage"):
        prepare_shares(node, "gpu-0", [refused])
