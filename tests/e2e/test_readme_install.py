"""README.md's "Install on a cluster" commands, run as written against the local node.

The e2e session's own release is uninstalled first (one driver per cluster: the
DeviceClasses have fixed names) and reinstalled afterwards. From the README's fenced
block, the test runs

- `REGISTRY=...` as written (the README's example registry: the local node pulls
  nothing, so any name works once the image is in the node's store);
- the README's "without Docker" build command (this machine has no Docker daemon),
  without `sudo` because the test runs as root;
- instead of `docker push` / `skopeo copy` to a registry, which the local cluster does
  not have: `ctr images import` of the built archive into the node's containerd, which
  is what a pull from the registry would leave there;
- `helm install` exactly as written, plus the `-f values-mock.yaml` the README says
  GPU-less clusters add,

and checks that the plugin pods run the README's image and publish the mock GPUs.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import DRIVER, E2E, NAMESPACE, RELEASE, REPO, install_chart, wait_for

README = REPO / "README.md"
SECTION = "## Install on a cluster"
NODE_MARKER = Path("/run/gpu-dra-local-node")
# values-mock.yaml's built-in fleet: 8 GPUs (the e2e session's demo fleet has 20).
MOCK_FLEET_GPUS = {f"gpu-{i}" for i in range(8)}
WHOLE_GPU = re.compile(r"^gpu-\d+$")


@dataclass(frozen=True)
class ReadmeInstall:
    """The commands of the README's install block that the local cluster can run."""

    registry: str  # the `REGISTRY=...` line
    docker_build: str
    build_without_docker: str
    registry_copy: str  # the skopeo command that pushes the archive
    helm_install: str
    gpu_less_args: str

    @property
    def archive(self) -> Path:
        """Where the no-Docker build writes the image (relative: the repository root)."""
        return REPO / self.build_without_docker.split("--output", 1)[1].split()[0]

    @property
    def release(self) -> str:
        return self.helm_install.split()[2]

    @property
    def namespace(self) -> str:
        return self.helm_install.split("--namespace", 1)[1].split()[0]


def install_block() -> list[str]:
    """The README's install commands as logical lines (continuations joined)."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", section, flags=re.DOTALL)
    assert blocks, f"README.md {SECTION!r} has no ```bash block"
    lines: list[str] = []
    pending = ""
    for raw in blocks[0].splitlines():
        command = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else raw
        if command.endswith("\\"):
            pending += command[:-1]
            continue
        lines.append((pending + command).strip())
        pending = ""
    return lines


def parse_install_block(lines: list[str]) -> ReadmeInstall:
    def one(pattern: str, what: str) -> str:
        found = [m for line in lines if (m := re.match(pattern, line))]
        assert len(found) == 1, f"README install block: expected one {what}, got {lines}"
        return found[0].group(1)

    return ReadmeInstall(
        registry=one(r"^(REGISTRY=\S+)$", "REGISTRY=... line"),
        docker_build=one(r"^(docker build .*)$", "docker build command"),
        build_without_docker=one(r"^#\s*without Docker:\s*(?:sudo\s+)?(.+)$", "no-Docker build"),
        registry_copy=one(r"^#\s*then:\s*(skopeo copy .+)$", "skopeo copy after it"),
        helm_install=one(r"^(helm install .*)$", "helm install command"),
        gpu_less_args=one(r"^#\s*GPU-less clusters: add\s+(.+)$", "GPU-less addition"),
    )


def test_readme_block_parses() -> None:
    """Fails first, naming the README line that moved, before the cluster is touched."""
    install = parse_install_block(install_block())
    assert "$REGISTRY/gpu-dra-driver:" in install.docker_build
    assert install.build_without_docker.startswith("hack/build-image.sh --tag $REGISTRY/")
    archive = install.archive.relative_to(REPO)
    assert install.registry_copy.startswith(f"skopeo copy oci-archive:{archive} docker://")
    assert "--set image.repository=$REGISTRY/gpu-dra-driver" in install.helm_install
    assert install.gpu_less_args == "-f deployments/helm/gpu-dra-driver/values-mock.yaml"


def bash(script: str, e: E2E, timeout: float) -> subprocess.CompletedProcess[str]:
    """`script` in the repository root, as a user's shell would run it, with the
    cluster's kubeconfig and the pinned helm first on PATH."""
    helm_dir = Path(e.helm).parent
    env = {
        **os.environ,
        "KUBECONFIG": str(e.kubeconfig),
        "PATH": f"{helm_dir}:{e.bin_dir}:{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{script}\nfailed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def node_ctr() -> list[str]:
    """`ctr` of the local node's containerd, from the node's ownership marker."""
    assert NODE_MARKER.is_file(), f"{NODE_MARKER} missing: no local node is running"
    marker = dict(
        line.split("=", 1) for line in NODE_MARKER.read_text().splitlines() if "=" in line
    )
    containerd = Path(f"/proc/{marker['containerd_pid']}/exe").resolve()
    ctr = containerd.parent / "ctr"
    assert ctr.is_file(), f"no ctr next to the node's containerd ({containerd})"
    return [str(ctr), "--address", marker["containerd_sock"], "--namespace", "k8s.io"]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr}"
    return proc


def whole_gpus(e: E2E) -> set[str]:
    return {name for name in e.devices() if WHOLE_GPU.match(name)}


@pytest.fixture
def without_session_release(e2e: E2E) -> Iterator[E2E]:
    """The session's release uninstalled for the test, reinstalled after it."""
    proc = e2e.helm_cmd("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "3m")
    assert proc.returncode == 0, proc.stderr
    e2e.installed = False
    # The kubelet deletes a deregistered driver's slices after its 30 s grace period.
    wait_for(lambda: not e2e.slices() or None, 120, f"no ResourceSlices of {DRIVER}")
    try:
        yield e2e
    finally:
        install_chart(e2e)


def test_readme_install_commands_work_as_written(without_session_release: E2E) -> None:
    e = without_session_release
    install = parse_install_block(install_block())
    registry = install.registry.split("=", 1)[1]
    image = f"{registry}/gpu-dra-driver:{install.helm_install.split('image.tag=')[1].split()[0]}"
    ctr = node_ctr()
    assert not install.archive.exists(), f"{install.archive} exists: not overwriting it"
    try:
        bash(f"{install.registry}\n{install.build_without_docker}", e, timeout=1200)
        run([*ctr, "images", "import", "--platform", "linux/amd64", str(install.archive)])
        assert image in run([*ctr, "images", "ls", "-q"]).stdout.split()

        bash(f"{install.registry}\n{install.helm_install} {install.gpu_less_args}", e, timeout=300)

        pods = e.wait_pods_ready(
            install.namespace, "app.kubernetes.io/component=kubeletplugin", 1, timeout=300
        )
        assert {c["image"] for p in pods for c in p["spec"]["containers"]} == {image}
        e.wait_pods_ready(install.namespace, "app.kubernetes.io/component=webhook", 2)
        wait_for(
            lambda: whole_gpus(e) == MOCK_FLEET_GPUS or None,
            180,
            f"the README release's plugin publishing {sorted(MOCK_FLEET_GPUS)}",
        )
        status = e.helm_cmd("status", install.release, "-n", install.namespace)
        assert status.returncode == 0 and "STATUS: deployed" in status.stdout, status.stdout
    finally:
        e.helm_cmd(
            "uninstall", install.release, "-n", install.namespace, "--wait", "--timeout", "3m"
        )
        e.kubectl("delete", "namespace", install.namespace, "--ignore-not-found", timeout=300)
        wait_for(lambda: not e.slices() or None, 120, "the README release's slices gone")
        subprocess.run([*ctr, "images", "rm", image], capture_output=True, check=False)
        for leftover in (install.archive, install.archive.with_suffix(".tar.partial")):
            leftover.unlink(missing_ok=True)
