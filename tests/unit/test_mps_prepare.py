"""MPS daemons through DeviceState on the mock (docs/mps.md): prepare starts one
daemon per device with the claim's limits and hands the container its pipe
directory; unprepare stops it; a plugin restart adopts it; a killed one is reported
and started again; where MPS cannot apply the claim is refused."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import PoolOptions
from driver.nvml.backend import NvmlBackend
from driver.nvml.mock.fleet import Fleet, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.mps import DaemonDirs, DaemonId, MpsControl, is_running
from driver.state.journal.checkpoint import Checkpoint
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import NodeDaemons, daemon_directory, daemon_dirs
from driver.state.prepare import DeviceState
from driver.state.recovery.startup_recovery import RecoveryReport
from driver.state.request import ClaimRef
from tests.state_fakes import node_state

DRIVER = "gpu.example.com"
NODE = "node-a"
# gpu-0 with MIG off, gpu-1 in MIG mode.
FLEET = parse_fleet(
    {"gpus": [{"model": "H100-80GB", "count": 1, "migMode": "disabled"}, {"model": "H100-80GB"}]}
)
LIMITS = {"defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "2Gi"}


class Claims:
    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}

    def add(self, uid: str, device: str = "gpu-0", mps: dict[str, Any] | None = None) -> ClaimRef:
        params = {
            "apiVersion": "gpu.resource.example.com/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": LIMITS if mps is None else mps},
        }
        result = {"request": "r0", "driver": DRIVER, "pool": NODE, "device": device}
        config = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}}
        self.docs[uid] = {
            "metadata": {"namespace": "default", "name": f"claim-{uid}", "uid": uid},
            "status": {"allocation": {"devices": {"results": [result], "config": [config]}}},
        }
        return ClaimRef("default", f"claim-{uid}", uid)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.docs[name.removeprefix("claim-")]


@dataclass
class Node:
    root: Path
    backend: NvmlBackend
    claims: Claims
    report: RecoveryReport = field(default_factory=RecoveryReport)
    options: PoolOptions = field(default_factory=PoolOptions)

    @property
    def control(self) -> MpsControl:
        control = self.backend.mps("/unused")
        assert control is not None
        return control

    def state(self, *, mps: bool = True) -> DeviceState:
        """A plugin (re)start on this node: a fresh DeviceState, recovered. `mps`
        False: with --mps-daemons=off (it can still stop the daemons its journal names)."""
        others = {} if mps else {"mps_others": (NodeDaemons(self.control),)}
        mps_control = self.control if mps else None
        state, self.report = node_state(
            self.root, self.claims, self.backend, self.options, mps=mps_control, **others
        )
        return state

    def record(self, uid: str) -> MpsRecord:
        (device,) = Checkpoint(self.root / "plugin").load()[uid].devices
        assert device.mps is not None
        return device.mps

    def dirs(self, record: MpsRecord) -> DaemonDirs:
        base = self.root / "plugin" / "mps" / record.directory
        return DaemonDirs(base / "pipe", base / "log")

    def daemons(self) -> list[int]:
        """The pids of every mock daemon running on this node's MPS root."""
        found = []
        for pid_file in (self.root / "plugin" / "mps").glob("*/pipe/*.pid"):
            dirs = DaemonDirs(pid_file.parent, pid_file.parent.parent / "log")
            daemon = self.control.running(dirs)
            if daemon is not None:
                found.append(daemon.pid)
        return found


def mps_node(tmp_path: Path, fleet: Fleet = FLEET) -> Iterator[Node]:
    """A node with the mock's stand-in daemon; its daemons killed at the end."""
    node = Node(
        tmp_path, MockBackend(MockNvml(fleet, NODE, driver_root=tmp_path / "root")), Claims()
    )
    yield node
    if (tmp_path / "plugin" / "mps").exists():
        for pid in node.daemons():  # a failed test leaves no daemon behind
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path)


def _shm_of(pid: int) -> tuple[int, int]:
    """The /dev/shm process `pid` sees (its mount namespace's), as (device, inode)."""
    found = os.stat(f"/proc/{pid}/root/dev/shm")
    return found.st_dev, found.st_ino


def ok(state: DeviceState, *refs: ClaimRef) -> None:
    results = state.prepare(list(refs))
    assert all(r.ok for r in results.values()), {u: str(r.error) for u, r in results.items()}


def test_prepare_starts_one_daemon_with_the_limits_and_unprepare_stops_it(node: Node) -> None:
    state = node.state()
    ref = node.claims.add("a")
    ok(state, ref)
    record = node.record("a")
    dirs = node.dirs(record)
    gpu0 = node.backend.discover().gpus[0].uuid
    assert record.gpu_uuid == gpu0 and record.directory == daemon_directory("a-gpu-0")
    assert (record.active_thread_percentage, record.pinned_memory_bytes) == (25, 2 << 30)
    assert node.daemons() == [record.pid]
    assert is_running(DaemonId(record.pid, record.start_time))
    # The daemon was started for the device's GPU alone and holds the limits.
    assert f"CUDA_VISIBLE_DEVICES={gpu0}\n" in (dirs.log / "control.log").read_text()
    assert node.control.command(dirs, "get_default_active_thread_percentage") == "25.0"
    assert node.control.command(dirs, "get_default_device_pinned_mem_limit 0") == "2048M"
    # The container gets the pipe directory and the limits.
    spec = json.loads(state.cdi.claim_spec_path("a").read_text())
    edits = spec["devices"][0]["containerEdits"]
    assert {
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M",
        "GPU_DEVICE_0_SHARING_STRATEGY=MPS",
    } <= set(edits["env"])
    shm = node.root / "plugin" / "mps" / record.directory / "shm"
    bind = ["rw", "nosuid", "nodev", "bind"]
    assert edits["mounts"] == [
        {"hostPath": str(dirs.pipe), "containerPath": "/tmp/nvidia-mps", "options": bind},
        {"hostPath": str(shm), "containerPath": "/dev/shm", "options": bind},
    ]
    # The daemon (and the server it forks) share that directory as their /dev/shm with
    # the containers: a file it makes there is the directory's.
    assert _shm_of(record.pid) == (shm.stat().st_dev, shm.stat().st_ino)
    assert _shm_of(os.getpid()) != _shm_of(record.pid)  # the node's stays the node's

    assert state.unprepare([ref]) == {"a": None}
    assert not is_running(DaemonId(record.pid, record.start_time))
    assert not (node.root / "plugin" / "mps" / "a-gpu-0").exists()


def test_a_plugin_restart_adopts_the_running_daemon(node: Node) -> None:
    ok(node.state(), node.claims.add("a"))
    before = node.record("a")
    state = node.state()  # the plugin restarts; the daemon is not its child
    assert node.report.mps_adopted == ("a",) and node.report.mps_lost == ()
    assert node.record("a") == before
    assert node.daemons() == [before.pid]
    assert state.unprepare([node.claims.add("a")]) == {"a": None}
    assert node.daemons() == []


def test_a_killed_daemon_is_reported_and_started_again_at_start(node: Node) -> None:
    ok(node.state(), node.claims.add("a"))
    killed = node.record("a")
    os.kill(killed.pid, signal.SIGKILL)
    while is_running(DaemonId(killed.pid, killed.start_time)):
        pass  # the daemon is no child of this process: init reaps it
    node.state()
    assert node.report.mps_lost == ("a",)
    again = node.record("a")
    assert again.pid != killed.pid and node.daemons() == [again.pid]
    dirs = node.dirs(again)
    assert node.control.command(dirs, "get_default_device_pinned_mem_limit 0") == "2048M"


def test_mps_on_a_mig_device_is_refused_for_good(node: Node) -> None:
    state = node.state()
    mig = next(name for name in state.devices if name.startswith("gpu-1-mig"))
    result = state.prepare([node.claims.add("m", mig)])["m"]
    assert result.error is not None and result.error.permanent
    assert "MPS is not possible on device" in str(result.error)
    assert node.daemons() == []


def test_a_node_without_mps_refuses_an_mps_claim(node: Node) -> None:
    state = node.state(mps=False)
    result = state.prepare([node.claims.add("a")])["a"]
    assert result.error is not None and result.error.permanent
    assert "MPS is not available on this node" in str(result.error)


def test_the_daemons_control_socket_fits_under_the_default_data_dir() -> None:
    """The daemon binds its control sockets in its pipe directory; a unix socket's path
    is at most 107 bytes. Named after the CDI device (claim UID, device, share id), the
    pipe directory took the mock's stand-in (and would take the real daemon) past it
    on the e2e cluster: `AF_UNIX path too long`."""
    cdi_name = "5c746777-279c-4b4a-b5b8-c9645ff04b90-gpu-16-7dc1de94-996e-4ba7-90f8-3d5e29ca0e97"
    record = MpsRecord("GPU-x", daemon_directory(cdi_name))
    pipe = daemon_dirs(Path("/var/lib/kubelet/plugins/gpu.example.com/mps"), record).pipe
    assert len(str(pipe / "control_privileged").encode()) <= 107
    assert len(record.directory) <= 63  # also a label value of the daemon's Deployment
