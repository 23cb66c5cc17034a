"""Claims given MPS shares of one GPU, prepared and unprepared on a node of
tests/gpu/node.py (the plugin's path, `--mps-daemons=node` when the node's
`mps_daemons` are `NodeDaemons`), and what is left of their daemons afterwards."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.nvml.mps import DaemonDirs, DaemonId, MpsControl, is_running, process_start_time
from driver.nvml.selection import select_backend
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from driver.state.request import ClaimRef
from tests.gpu.node import NODE, GpuNode, open_node

MIB_PER_GIB = 1024


def mock_share_node(tmp_path: Path) -> tuple[GpuNode, MpsControl]:
    """A tier node on one mock H100 with MIG off, shareable by capacity, whose MPS
    daemons are the mock's stand-in as `--mps-daemons=node` runs it (the CPU-side
    tests of what tests/gpu/test_mps_containers.py prepares)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"gpus": [{"model": "H100-80GB", "migMode": "disabled"}]}))
    backend = select_backend(
        mock=True, fleet_path=fleet, node_name=NODE, mock_driver_root=tmp_path / "driver-root"
    )
    control = backend.mps("/unused")
    assert control is not None
    node = open_node(
        backend, tmp_path, mps_daemons=NodeDaemons(control), allow_multiple_allocations=True
    )
    return node, control


@dataclass(frozen=True)
class MpsShare:
    """A claim's share of a GPU with its MPS limits: pinned device memory (MiB) and
    active-thread percentage."""

    uid: str
    memory_mib: int
    threads: int

    def parameters(self) -> dict[str, Any]:
        """The claim's GpuConfig."""
        limits = {
            "defaultActiveThreadPercentage": self.threads,
            "defaultPinnedDeviceMemoryLimit": f"{self.memory_mib}Mi",
        }
        return {
            "apiVersion": "gpu.resource.example.com/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": limits},
        }

    def consumed(self) -> dict[str, str]:
        """The capacity the scheduler gave the share: its memory limit in whole Gi (the
        request policy's step), at least 1Gi, and its thread percentage as compute (a
        share without compute would count as the whole GPU's)."""
        gib = max(1, -(-self.memory_mib // MIB_PER_GIB))
        return {"memory": f"{gib}Gi", "compute": str(self.threads)}


@dataclass(frozen=True)
class PreparedShare:
    share: MpsShare
    ref: ClaimRef
    cdi_devices: tuple[str, ...]
    record: MpsRecord  # as the journal holds it once prepared: with the daemon's pid
    dirs: DaemonDirs
    directory: Path  # the daemon's own directory (pipe, log), removed at unprepare


def prepare_shares(node: GpuNode, device: str, shares: Sequence[MpsShare]) -> list[PreparedShare]:
    """Each share prepared in a call of its own (two pods' claims), as the kubelet
    would; AssertionError naming the claim whose prepare fails."""
    prepared = []
    for share in shares:
        ref = node.claims.add_share(
            share.uid, device, f"share-{share.uid}", share.consumed(), share.parameters()
        )
        result = node.state.prepare([ref])[share.uid]
        assert result.ok, f"claim {share.uid}: {result.error}"
        (journaled,) = node.state.checkpoint.load()[share.uid].devices
        assert journaled.mps is not None, f"claim {share.uid}: no MPS daemon in the journal"
        record = journaled.mps
        dirs = daemon_dirs(node.state.mps.root, record)
        cdi = tuple(i for d in result.devices for i in d.cdi_device_ids)
        prepared.append(
            PreparedShare(share, ref, cdi, record, dirs, node.state.mps.root / record.directory)
        )
    return prepared


def unprepare_shares(node: GpuNode, prepared: Sequence[PreparedShare]) -> None:
    refs = [p.ref for p in prepared]
    assert node.state.unprepare(refs) == {p.share.uid: None for p in prepared}


def running_ids(pids: Sequence[int]) -> list[DaemonId]:
    """The processes of `pids` that run now, told apart from later ones that reuse a
    pid."""
    found = [(pid, process_start_time(pid)) for pid in pids]
    return [DaemonId(pid, start) for pid, start in found if start is not None]


def left_running(processes: Sequence[DaemonId], wait: float = 30.0) -> list[int]:
    """The pids of those that still run after up to `wait` seconds (an MPS server ends
    as its control daemon quits, not necessarily before it)."""
    give_up = time.monotonic() + wait
    while any(map(is_running, processes)) and time.monotonic() < give_up:
        time.sleep(0.1)
    return [p.pid for p in processes if is_running(p)]
