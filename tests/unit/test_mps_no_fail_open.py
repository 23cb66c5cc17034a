"""No fail-open restart of an MPS daemon (issue 44, item 4; docs/mps.md, "Lifecycle").

A claim's running containers hold bind mounts of its daemon's `pipe` and `shm`
directories: the directories themselves (their inodes), not their paths. A daemon
started again in a new directory at the same path would serve nobody in them: each
new CUDA process there finds no daemon behind its mount and runs without MPS,
unlimited. So a revived daemon keeps those directories (their contents emptied), and
a container's mount reaches it. The tests hold the directories as a container's mount
does, by an open descriptor, and run the mock's MPS client stand-in
(`nvidia-cuda-mps-control` without arguments) through it.

Also here: the daemon's pid is kept where its clients cannot write, `quit -t` bounds
how long a stopping daemon waits for its clients, and the daemon's pod is Guaranteed
and node-critical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.nvml.mock.mps_control import install_mps_control
from driver.nvml.mps import DaemonDirs, MpsControl, find_binary, is_running
from driver.state.mps_watch import MpsWatch
from driver.state.prepare import DeviceState
from tests.unit import test_mps_kube as kube
from tests.unit.test_mps_prepare import Node, _shm_of, mps_node, ok
from tests.unit.test_mps_watch import Events, kill

PIPE, SHM = "/tmp/nvidia-mps", "/dev/shm"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path)


def _inode(path: Path | int) -> tuple[int, int]:
    found = os.fstat(path) if isinstance(path, int) else path.stat()
    return found.st_dev, found.st_ino


def _mounted(state: DeviceState, uid: str) -> dict[str, Path]:
    """The host directories the claim's containers mount, by where they see them."""
    spec = json.loads(state.cdi.claim_spec_path(uid).read_text())
    (device,) = spec["devices"]
    return {m["containerPath"]: Path(m["hostPath"]) for m in device["containerEdits"]["mounts"]}


class Mounts:
    """A running container's bind mounts of the claim's directories: open descriptors
    of the directories, which keep what they were opened on (a removed directory stays
    reachable through them, empty, with no link left)."""

    def __init__(self, state: DeviceState, uid: str) -> None:
        mounted = _mounted(state, uid)
        self.pipe, self.shm = mounted[PIPE], mounted[SHM]
        self.fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in (self.pipe, self.shm)}
        self.inodes = {p: _inode(fd) for p, fd in self.fds.items()}

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)

    def client(self, driver_root: Path, line: str) -> subprocess.CompletedProcess[str]:
        """A new MPS client in the container: the mock's client stand-in with
        CUDA_MPS_PIPE_DIRECTORY at the container's pipe mount."""
        binary = find_binary(driver_root)
        assert binary is not None
        fd = self.fds[self.pipe]
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"/proc/self/fd/{fd}"}
        return subprocess.run(
            [str(binary)], input=line + "\n", env=env, pass_fds=(fd,),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    def assert_kept(self) -> None:
        for path, fd in self.fds.items():
            assert os.fstat(fd).st_nlink > 0, f"{path} was removed under the containers' mounts"
            assert _inode(path) == self.inodes[path], f"{path} is another directory now"


def test_a_revived_daemon_serves_the_directories_its_clients_containers_mounted(
    node: Node,
) -> None:
    state = node.state()
    ok(state, node.claims.add("a"))
    killed = node.record("a")
    mounts = Mounts(state, "a")
    try:
        answer = mounts.client(node.control.driver_root, "get_default_active_thread_percentage")
        assert answer.stdout.strip() == "25.0", answer.stderr  # the client reaches its daemon
        (mounts.shm / "cuda.shm.1").write_bytes(b"what the lost server shared")
        kill(killed)

        (seen,) = MpsWatch(state, Events()).check()

        again = node.record("a")
        assert seen.running and again.pid != killed.pid
        # A new process of a running container reaches the new daemon, limited.
        answer = mounts.client(node.control.driver_root, "get_default_device_pinned_mem_limit 0")
        assert (answer.returncode, answer.stdout.strip()) == (0, "2048M"), answer.stderr
        mounts.assert_kept()
        assert list(mounts.shm.iterdir()) == []  # the lost server's files are gone
        assert _shm_of(again.pid) == mounts.inodes[mounts.shm]  # the new one shares it
    finally:
        mounts.close()


def test_a_daemon_revived_at_the_plugins_start_keeps_the_directories_too(node: Node) -> None:
    ok(node.state(), node.claims.add("a"))
    mounts = Mounts(node.state(), "a")
    try:
        kill(node.record("a"))
        node.state()  # the plugin restarts and finds it gone
        assert node.report.mps_lost == ("a",)
        mounts.assert_kept()
        answer = mounts.client(node.control.driver_root, "get_default_active_thread_percentage")
        assert (answer.returncode, answer.stdout.strip()) == (0, "25.0"), answer.stderr
    finally:
        mounts.close()


def test_a_recreated_daemon_deployment_mounts_the_same_host_directories(
    tmp_path: Path,
) -> None:
    node = kube.Node(tmp_path)
    state = node.state()
    ok(state, node.claims.add("a"))
    before = node.record("a")
    mounts = Mounts(state, "a")
    try:
        (mounts.pipe / "control").write_text("the lost daemon's socket")
        (mounts.shm / "cuda.shm.1").write_bytes(b"what the lost server shared")
        del node.cluster.deployments[before.deployment]  # deleted behind the driver's back
        node.cluster.pods.pop(before.deployment)

        (seen,) = MpsWatch(state, Events()).check()

        assert seen.running and node.record("a").deployment_uid != before.deployment_uid
        mounts.assert_kept()
        assert list(mounts.pipe.iterdir()) == [] and list(mounts.shm.iterdir()) == []
    finally:
        mounts.close()


@pytest.fixture
def control(tmp_path: Path) -> Iterator[MpsControl]:
    install_mps_control(tmp_path / "root")
    control = MpsControl(tmp_path / "root")
    yield control
    for pid_file in tmp_path.glob("**/*.pid"):  # a failed test leaves no daemon behind
        daemon = control.running(DaemonDirs(pid_file.parent, pid_file.parent))
        if daemon is not None:
            os.kill(daemon.pid, signal.SIGKILL)


def test_the_daemon_is_known_by_a_pid_file_its_clients_cannot_write(
    tmp_path: Path, control: MpsControl
) -> None:
    """The claim's containers mount the pipe directory read-write, and the daemon
    writes its pid file there: a tenant could name any process in it. The driver finds
    its daemon by its own copy, in the log directory, which no container mounts."""
    dirs = DaemonDirs(tmp_path / "d" / "pipe", tmp_path / "d" / "log")
    daemon = control.start(dirs, ["GPU-a"])
    decoy = subprocess.Popen(["sleep", "300"])
    try:
        (dirs.pipe / "nvidia-cuda-mps-control.pid").write_text(f"{decoy.pid}\n")  # a tenant
        assert control.running(dirs) == daemon
        control.stop(dirs, control.running(dirs))
        assert not is_running(daemon) and decoy.poll() is None
        assert control.running(dirs) is None
    finally:
        decoy.kill()
        decoy.wait()


def test_a_daemon_whose_start_was_cut_short_is_still_found_but_no_decoy(
    tmp_path: Path, control: MpsControl
) -> None:
    """A plugin killed between the daemon's start and its own copy of the pid: the
    daemon's pid file names it, and it was told this pipe directory; a process a
    tenant names there was not."""
    dirs = DaemonDirs(tmp_path / "d" / "pipe", tmp_path / "d" / "log")
    daemon = control.start(dirs, ["GPU-a"])
    dirs.pid_file.unlink()
    assert control.running(dirs) == daemon
    decoy = subprocess.Popen(["sleep", "300"])
    try:
        (dirs.pipe / "nvidia-cuda-mps-control.pid").write_text(f"{decoy.pid}\n")
        assert control.running(dirs) is None
    finally:
        decoy.kill()
        decoy.wait()
        os.kill(daemon.pid, signal.SIGKILL)


def test_stopping_bounds_how_long_the_daemon_waits_for_its_clients(
    tmp_path: Path, control: MpsControl
) -> None:
    """`quit -t <seconds>` (nvidia-cuda-mps-control(1)): the daemon stops taking
    clients and, after that many seconds, ends the MPS servers whose clients have not
    exited, instead of waiting for them without end."""
    dirs = DaemonDirs(tmp_path / "d" / "pipe", tmp_path / "d" / "log")
    daemon = control.start(dirs, ["GPU-a"])
    control.stop(dirs, daemon)
    assert not is_running(daemon)
    assert "command 'quit -t 10'" in (dirs.log / "control.log").read_text()


def test_the_daemons_pod_is_guaranteed_and_node_critical(tmp_path: Path) -> None:
    """Requests equal limits for CPU and memory (QoS Guaranteed: evicted last under
    node pressure, never for using more than it asked) and priority class
    system-node-critical (not preempted for other pods): the pod going is every
    client's GPU work lost."""
    node = kube.Node(tmp_path)
    ok(node.state(), node.claims.add("a"))
    pod = node.cluster.deployments[node.record("a").deployment]["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    (container,) = pod["containers"]
    resources = container["resources"]
    assert set(resources) == {"requests", "limits"}
    assert set(resources["limits"]) == {"cpu", "memory"}
    assert resources["requests"] == resources["limits"]
