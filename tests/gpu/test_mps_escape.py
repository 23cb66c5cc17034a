"""A process that points `CUDA_MPS_PIPE_DIRECTORY` elsewhere, on a GPU with a claim's
MPS share (docs/mps.md, "What holds and what does not" and "Escapes"):

- cooperative (compute mode `Default`, what every node with MPS daemons publishes as
  `mpsIsolation: "cooperative"`): it gets a CUDA context of its own, with the GPU's
  memory, not the share's limit, and the plugin's check (driver/health/mps_escapes.py,
  on the host's NVML) reports it, and only it: an `MPSEscape` Event on the claim and
  `gpu_dra_mps_escapes_total{gpu=<UUID>}` counted once;
- strict (a device that publishes `mpsIsolation: "strict"`: the driver puts the GPU of
  a whole-GPU MPS claim in compute mode `EXCLUSIVE_PROCESS`): it cannot create a CUDA
  context at all, while the claim's own client can, and unprepare gives the GPU its
  compute mode back. Where no device publishes `"strict"` (the driver has no strict
  mode) the test skips with one line.

MIG mode is never touched; the compute mode is checked unchanged at the end."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from driver.devices.model import MPS_ISOLATION_ATTRIBUTE
from driver.health.mps_escapes import REASON_ESCAPE, MpsEscapes
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import MpsControl
from driver.observability import metrics
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from driver.state.request import ClaimRef
from tests.gpu.bound_clients import Client, context_memory, finish, reach, release
from tests.gpu.cuda_bound import HOLDING, READY
from tests.gpu.mps_clients import BOUND, Share, argv, client_env, node_daemons, record, start, stop
from tests.gpu.mps_gate import SEVERAL_SERVERS, compute_mode, require_mps
from tests.gpu.mps_shares import MpsShare
from tests.gpu.node import DRIVER, open_node

ROOT = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
LIMIT_MIB = 2048
THREADS = 50
STRICT = "strict"
EXCLUSIVE_PROCESS = "Exclusive_Process"


@dataclass(frozen=True)
class Device:
    name: str
    gpu_uuid: str


@dataclass(frozen=True)
class CooperativeShare:
    claim: ClaimRef
    device: str
    gpu_uuid: str


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[ClaimRef, str, str]] = []

    def post(self, claim: ClaimRef, reason: str, message: str) -> None:
        self.posted.append((claim, reason, message))


def _escapes_counted(uuid: str) -> float:
    sample = metrics.REGISTRY.get_sample_value("gpu_dra_mps_escapes_total", {"gpu": uuid})
    return sample or 0.0


def test_a_process_outside_mps_is_reported_under_cooperative_mode(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    mode = require_mps(ROOT, whole_gpu.uuid, SEVERAL_SERVERS)
    uuid = whole_gpu.uuid
    elsewhere = tmp_path / "elsewhere"  # no daemon there: CUDA runs without MPS
    elsewhere.mkdir()
    control = MpsControl(ROOT)
    share = Share("cooperative", THREADS, LIMIT_MIB)
    with node_daemons(control, tmp_path / "mps", uuid, [share]) as (mps, daemons):
        (daemon,) = daemons
        inside = start("inside", daemon.pipe(mps), uuid, namespace_of=daemon.record.pid)
        outside = start("outside", elsewhere, uuid, namespace_of=None)
        clients = [inside, outside]
        try:
            reach(clients, READY)
            inside_free, outside_free = (context_memory(c.lines)[0] for c in clients)
            record("cooperative_inside_free_mib", inside_free)
            record("cooperative_outside_free_mib", outside_free)
            assert inside_free < LIMIT_MIB < outside_free, (inside_free, outside_free)
            release(clients)
            reach(clients, HOLDING)
            claim = ClaimRef("default", "claim-cooperative", "claim-cooperative")
            events = Events()
            checker = MpsEscapes(
                backend.gpu_processes,
                events,
                [Device("gpu-0", uuid)],
                driver=DRIVER,
                claim_pods=lambda ref: None,
            )
            counted = _escapes_counted(uuid)
            found = checker.check([CooperativeShare(claim, "gpu-0", uuid)])
            record("cooperative_escapes", [(e.pid, e.name, e.used_bytes) for e in found])
            pids = {e.pid for e in found}
            assert outside.proc.pid in pids, found
            assert inside.proc.pid not in pids, found
            assert _escapes_counted(uuid) - counted == len(found)
            assert checker.check([CooperativeShare(claim, "gpu-0", uuid)]) == []  # once
            reasons = [
                (ref, reason)
                for ref, reason, text in events.posted
                if str(outside.proc.pid) in text
            ]
            assert (claim, REASON_ESCAPE) in reasons, events.posted
            release(clients)
            assert finish(clients) == [0, 0], "\n".join(c.said() for c in clients)
        finally:
            stop(clients)
    assert compute_mode(uuid) == mode


def test_a_process_outside_mps_is_refused_under_strict_mode(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    mode = require_mps(ROOT, whole_gpu.uuid)
    uuid = whole_gpu.uuid
    control = MpsControl(ROOT)
    node = open_node(backend, tmp_path, mps_daemons=NodeDaemons(control))
    published = {
        d.name: d.document["attributes"].get(MPS_ISOLATION_ATTRIBUTE, {}).get("string")
        for d in node.pool.devices_of_gpu(uuid)
    }
    strict = [name for name, isolation in published.items() if isolation == STRICT]
    if not strict:
        pytest.skip(
            f'strict MPS: no device of GPU {uuid} publishes {MPS_ISOLATION_ATTRIBUTE} "{STRICT}" '
            f"({sorted(set(map(str, published.values())))}): the driver has no strict mode here"
        )
    uid = "strict"
    parameters = MpsShare(uid, LIMIT_MIB, THREADS).parameters()
    ref = node.claims.add_configured(uid, strict[0], parameters)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    clients: list[Client] = []
    try:
        result = node.state.prepare([ref])[uid]
        assert result.ok, result.error
        assert compute_mode(uuid) == EXCLUSIVE_PROCESS
        (device,) = node.state.checkpoint.load()[uid].devices
        assert device.mps is not None
        dirs = daemon_dirs(node.state.mps.root, device.mps)
        clients.append(start("inside", dirs.pipe, uuid, namespace_of=device.mps.pid))
        reach(clients, READY)
        free = context_memory(clients[0].lines)[0]
        assert 0 < free < LIMIT_MIB, clients[0].said()
        # Its stdin closed at once: were its context made, it would run to its end.
        outside = subprocess.run(
            argv(BOUND, ["64"], namespace_of=None),
            env=client_env(elsewhere, uuid),
            input="",
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        said = (outside.stdout + outside.stderr).strip()
        record("strict_outside", f"exit {outside.returncode}: {said!r}")
        assert outside.returncode == 4 and "memory free=" not in said, said
        release(clients)
        reach(clients, HOLDING)
        release(clients)
        assert finish(clients) == [0], clients[0].said()
    finally:
        stop(clients)
        released = node.state.unprepare([ref])
    assert released == {uid: None}
    assert compute_mode(uuid) == mode
