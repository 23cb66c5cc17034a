"""node_host_guard of hack/lib/node.sh: the local node refuses foreign node state.

`up --with-node` and `down` used to unmount /var/lib/kubelet/pods and /plugins, delete
every /var/run/netns/cni-* and run `rm -rf /var/lib/kubelet` on any machine. The guard
runs first and refuses unless the node marker (or the stamp in the kubelet root) proves
the state is ours. These tests plant a foreign kubelet tree, a listener, a containerd
socket, a pod netns and a process named like the kubelet in a temporary directory and
on loopback ports (every host path and port of the guard is overridable), run the guard
through `hack/local-cluster.sh node-preflight` or by sourcing the lib, and check the
refusal and that nothing planted was touched. No cluster, no root paths.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "local-cluster.sh"
HACK_DIR = REPO / "hack"


@pytest.fixture(autouse=True)
def _tools_present() -> None:
    """The guard is bash and findmnt: a machine without them fails, naming them."""
    missing = [tool for tool in ("bash", "findmnt") if shutil.which(tool) is None]
    assert not missing, f"the node guard needs {', '.join(missing)}: install them"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Host:
    """A stand-in for the host paths of the node, all under one temporary dir."""

    root: Path
    healthz_port: int
    kubelet_port: int
    process_name: str

    @property
    def run_dir(self) -> Path:
        return self.root / "cluster"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "var/lib/kubelet"

    @property
    def marker(self) -> Path:
        return self.root / "run/gpu-dra-local-node"

    @property
    def netns_dir(self) -> Path:
        return self.root / "var/run/netns"

    @property
    def containerd_dir(self) -> Path:
        return self.root / "run/containerd"

    @property
    def cni_state_dir(self) -> Path:
        return self.root / "var/lib/cni/networks"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            GPU_DRA_CLUSTER_DIR=str(self.run_dir),
            GPU_DRA_KUBELET_ROOT=str(self.kubelet_root),
            GPU_DRA_NODE_MARKER=str(self.marker),
            GPU_DRA_NETNS_DIR=str(self.netns_dir),
            GPU_DRA_HOST_CONTAINERD_DIR=str(self.containerd_dir),
            GPU_DRA_CNI_STATE_DIR=str(self.cni_state_dir),
            GPU_DRA_KUBELET_HEALTHZ_PORT=str(self.healthz_port),
            GPU_DRA_KUBELET_PORT=str(self.kubelet_port),
            # A name no real process has: a kubelet of another engineer's cluster on
            # this machine must not change the outcome.
            GPU_DRA_KUBELET_PROCESS_NAME=self.process_name,
        )
        return env

    def plant_foreign_kubelet_tree(self) -> None:
        pod = self.kubelet_root / "pods" / "x"
        pod.mkdir(parents=True)
        (pod / "volume-data").write_text("somebody else's pod\n")
        (self.kubelet_root / "plugins" / "other.example.com").mkdir(parents=True)
        (self.kubelet_root / "config.yaml").write_text("kind: KubeletConfiguration\n")

    def write_marker(self, run_dir: Path | None = None, **extra: str) -> None:
        owner = run_dir or self.run_dir
        lines = [
            "# hack/lib/node.sh: the local node of this machine",
            f"run_dir={owner}",
            f"kubelet_root={self.kubelet_root}",
            f"containerd_dir={owner}/node/containerd",
            f"containerd_sock={owner}/node/containerd/containerd.sock",
        ]
        lines += [f"{k}={v}" for k, v in extra.items()]
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text("\n".join(lines) + "\n")

    def snapshot(self) -> dict[str, str]:
        """Every path under the temporary root with its content (or kind)."""
        out: dict[str, str] = {}
        for p in sorted(self.root.rglob("*")):
            rel = str(p.relative_to(self.root))
            if p.is_symlink():
                out[rel] = "symlink:" + os.readlink(p)
            elif p.is_socket():
                out[rel] = "socket"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_text(errors="replace")
        return out


@pytest.fixture
def host() -> Iterator[Host]:
    # Short: a unix socket path must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="gdguard-"))
    try:
        yield Host(
            root=root,
            healthz_port=free_port(),
            kubelet_port=free_port(),
            process_name=f"gd-kubelet-{uuid.uuid4().hex[:8]}",
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def listener(host: Host) -> Iterator[socket.socket]:
    """Something else listening on the kubelet healthz port (127.0.0.1 only)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", host.healthz_port))
    s.listen()
    try:
        yield s
    finally:
        s.close()


def preflight(host: Host) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), "node-preflight"],
        env=host.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def mounts_under(root: Path) -> list[str]:
    """Mount points in the planted tree (the rest of the table may change meanwhile)."""
    table = subprocess.run(["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True)
    return [m for m in table.stdout.splitlines() if m == str(root) or m.startswith(f"{root}/")]


def run_lib(host: Host, body: str) -> subprocess.CompletedProcess[str]:
    """Source hack/lib/common.sh and node.sh (as hack/local-cluster.sh does) and run body."""
    script = (
        "set -euo pipefail\n"
        f"HACK_DIR={HACK_DIR}\n"
        'source "$HACK_DIR/lib/common.sh"\n'
        'source "$HACK_DIR/lib/node.sh"\n' + body
    )
    return subprocess.run(
        ["bash", "-c", script],
        env=host.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    message = proc.stderr
    assert "refusing to" in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert "To proceed" in message, message
    return message


# --- refusals ---------------------------------------------------------------------


def test_foreign_kubelet_tree_and_port_are_refused_untouched(
    host: Host, listener: socket.socket
) -> None:
    host.plant_foreign_kubelet_tree()
    before = host.snapshot()
    mounts_before = mounts_under(host.root)

    message = assert_refused(
        preflight(host),
        f"path {host.kubelet_root}: a kubelet root that is not ours",
        f"port {host.healthz_port} (kubelet healthz): listening on 127.0.0.1:{host.healthz_port}",
        f"no node marker {host.marker}",
        "Nothing was stopped, unmounted or deleted.",
        "GPU_DRA_KUBELET_ROOT=<dir>",
    )
    if os.geteuid() == 0:  # ss -p names the owner only for root
        assert f"pid {os.getpid()}" in message, message

    assert host.snapshot() == before
    assert mounts_under(host.root) == mounts_before


def test_up_node_refuses_before_any_destructive_step(host: Host, listener: socket.socket) -> None:
    """up_node itself: nothing stopped, cleaned, unmounted or created once refused."""
    host.plant_foreign_kubelet_tree()
    before = host.snapshot()
    calls = host.root.parent / f"{host.root.name}.calls"
    stubs = [
        "stop_component",
        "kill_node_containers",
        "cleanup_node_state",
        "stop_node_leftovers",
        "unmount_under",
        "prepare_host",
        "write_node_marker",
        "write_cni_config",
        "write_containerd_config",
        "write_kubelet_config",
        "start_containerd",
        "start_api_proxy",
        "start_kubelet",
        "ensure_images",
        "cmd_build_node",
    ]
    body = (
        "have_runtime_binaries() { return 0; }\n"
        "have_binaries() { return 0; }\n"
        "node_apt_missing() { :; }\n"
        + "".join(f'{f}() {{ echo {f} >>"{calls}"; }}\n' for f in stubs)
        + "up_node\n"
        + "echo UP_NODE_RETURNED\n"
    )
    try:
        proc = run_lib(host, body)
        assert_refused(proc, "refusing to set up the node", str(host.kubelet_root))
        assert "UP_NODE_RETURNED" not in proc.stdout
        assert not calls.exists(), calls.read_text()
    finally:
        calls.unlink(missing_ok=True)
    assert host.snapshot() == before
    assert not host.marker.exists()


def test_cleanup_refuses_without_a_passing_guard(host: Host) -> None:
    host.plant_foreign_kubelet_tree()
    before = host.snapshot()
    proc = run_lib(host, "cleanup_node_state\n")
    assert proc.returncode != 0
    assert "without a passing node_host_guard" in proc.stderr, proc.stderr
    assert host.snapshot() == before


def test_down_leaves_foreign_host_state_alone(host: Host, listener: socket.socket) -> None:
    """`down` still stops what is ours, touches nothing else and exits 1."""
    host.plant_foreign_kubelet_tree()
    (host.run_dir / "node").mkdir(parents=True)
    before = host.snapshot()
    proc = subprocess.run(
        [str(SCRIPT), "down"], env=host.env(), capture_output=True, text=True, timeout=60
    )
    assert_refused(
        proc,
        "refusing to clean up the node's host state",
        str(host.kubelet_root),
        f"port {host.healthz_port}",
        "down left the node's host state alone",
    )
    assert host.snapshot() == before


def test_containerd_socket_is_refused_even_with_our_marker(host: Host) -> None:
    host.write_marker()
    host.containerd_dir.mkdir(parents=True)
    sock_path = host.containerd_dir / "containerd.sock"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(sock_path))
        sock.listen()
        message = assert_refused(
            preflight(host),
            f"socket {sock_path}: a containerd this script did not start",
            f"node marker {host.marker} names this run dir",
        )
        if os.geteuid() == 0:
            assert f"pid {os.getpid()}" in message, message
        assert sock_path.is_socket()
    finally:
        sock.close()


def test_pod_netns_without_marker_is_refused(host: Host) -> None:
    host.netns_dir.mkdir(parents=True)
    ns = host.netns_dir / "cni-0b6f8e1c-3f2a-4f7e-9d41-5a7c2e9b1d00"
    ns.write_text("")
    assert_refused(preflight(host), f"netns {ns}: a pod network namespace")
    assert ns.exists()


def test_pod_netns_in_use_by_a_foreign_process_is_refused_even_with_our_marker(
    host: Host,
) -> None:
    """A netns someone's process lives in is not ours, marker or not."""
    host.write_marker()
    host.netns_dir.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "60"])
    ns = host.netns_dir / "cni-1d7c1a52-2b1e-4c55-8e0a-3c0f6f2f9e11"
    try:
        # Stands for a bind mount of a pod's netns: stat -L reaches the same nsfs inode.
        ns.symlink_to(f"/proc/{sleeper.pid}/ns/net")
        assert_refused(
            preflight(host),
            f"netns {ns}: in use by",
            "not containers of our containerd",
            f"node marker {host.marker} names this run dir",
        )
        assert ns.is_symlink()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_kubelet_process_is_refused(host: Host) -> None:
    proc = subprocess.Popen(["bash", "-c", f"exec -a {host.process_name} sleep 60"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the exec happened
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            if cmdline.startswith(host.process_name.encode()):
                break
            time.sleep(0.05)
        assert_refused(
            preflight(host), f"process {proc.pid} ({host.process_name}): {host.process_name} 60"
        )
        assert proc.poll() is None, "the guard must not signal the process"
    finally:
        proc.kill()
        proc.wait()


def _kubelet_named_process(host: Host, *unshare: str) -> subprocess.Popen[bytes]:
    """A process named like the kubelet, in new namespaces of the kinds `unshare` names."""
    command = f"exec -a {host.process_name} sleep 60"
    proc = subprocess.Popen(["unshare", *unshare, "bash", "-c", command])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the exec happened
        if Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(host.process_name.encode()):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the kubelet-named process never started")


def test_a_kubelet_in_a_container_node_is_not_this_hosts(host: Host) -> None:
    """A kind node's kubelet lives in its container's mount and network namespaces: it
    has its own /var/lib/kubelet and ports, so a local node beside it is not refused."""
    proc = _kubelet_named_process(host, "--mount", "--net")
    try:
        result = preflight(host)
        assert result.returncode == 0, result.stderr
        assert "no foreign node state" in result.stdout
    finally:
        proc.kill()
        proc.wait()


def test_a_kubelet_sharing_this_hosts_network_is_refused(host: Host) -> None:
    proc = _kubelet_named_process(host, "--mount")
    try:
        assert_refused(preflight(host), f"process {proc.pid} ({host.process_name})")
    finally:
        proc.kill()
        proc.wait()


def test_marker_recording_another_kubelet_root_does_not_cover_this_one(host: Host) -> None:
    host.plant_foreign_kubelet_tree()
    host.marker.parent.mkdir(parents=True)
    host.marker.write_text(f"run_dir={host.run_dir}\nkubelet_root=/elsewhere/kubelet\n")
    assert_refused(
        preflight(host),
        f"path {host.kubelet_root}",
        "the node marker records kubelet root /elsewhere/kubelet",
    )


def test_marker_of_a_running_node_from_another_run_dir_is_refused(host: Host) -> None:
    other = host.root / "other-cluster"
    # A process whose command line names the other run dir plays its kubelet.
    kubelet = subprocess.Popen(
        ["python3", "-c", "import time; time.sleep(60)", f"--config={other}/node/kubelet.yaml"]
    )
    try:
        host.write_marker(run_dir=other, kubelet_pid=str(kubelet.pid))
        host.plant_foreign_kubelet_tree()
        assert_refused(
            preflight(host),
            f"run dir {other} owns the node and its kubelet (pid {kubelet.pid}) still runs",
            f"GPU_DRA_CLUSTER_DIR={other} hack/local-cluster.sh down",
        )
    finally:
        kubelet.kill()
        kubelet.wait()


# --- our own state passes ---------------------------------------------------------


def test_our_marker_passes(host: Host) -> None:
    host.plant_foreign_kubelet_tree()  # the same tree, but now the marker records it
    host.write_marker()
    proc = preflight(host)
    assert proc.returncode == 0, proc.stderr
    assert "no foreign node state" in proc.stdout


def test_stamp_in_the_kubelet_root_passes_without_marker(host: Host) -> None:
    """After a reboot /run (and the marker) is gone; the stamp in the tree remains."""
    host.plant_foreign_kubelet_tree()
    (host.kubelet_root / ".gpu-dra-local-node").write_text(f"{host.run_dir}\n")
    proc = preflight(host)
    assert proc.returncode == 0, proc.stderr


def test_marker_of_a_dead_run_dir_passes(host: Host) -> None:
    """A crashed or killed cluster of ours from another run dir: taken over."""
    host.plant_foreign_kubelet_tree()
    host.write_marker(run_dir=host.root / "crashed-cluster", kubelet_pid="999999999")
    proc = preflight(host)
    assert proc.returncode == 0, proc.stderr
    assert "which no longer runs a kubelet" in proc.stdout


def test_empty_kubelet_root_passes(host: Host) -> None:
    host.kubelet_root.mkdir(parents=True)
    proc = preflight(host)
    assert proc.returncode == 0, proc.stderr


def test_our_leftovers_are_cleaned_up(host: Host) -> None:
    """With our marker, cleanup_node_state removes the tree and the pod netns as before."""
    host.plant_foreign_kubelet_tree()
    host.write_marker()
    host.netns_dir.mkdir(parents=True)
    ns = host.netns_dir / "cni-0b6f8e1c-3f2a-4f7e-9d41-5a7c2e9b1d00"
    ns.write_text("")  # a leftover of ours: no process in it
    ipam = host.cni_state_dir / "gpu-dra-podnet"
    ipam.mkdir(parents=True)
    (ipam / "10.88.0.5").write_text("leftover\n")
    body = (
        # The pod bridge is a real host interface: leave it out of this test.
        'ip() { return 1; }\nnode_host_guard "set up the node"\ncleanup_node_state\necho CLEANED\n'
    )
    proc = run_lib(host, body)
    assert proc.returncode == 0, proc.stderr
    assert "CLEANED" in proc.stdout
    assert not host.kubelet_root.exists()
    assert not ns.exists()
    assert not ipam.exists()
    assert host.marker.exists()  # removed by down_node only
