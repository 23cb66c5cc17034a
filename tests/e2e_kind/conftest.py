"""Fixtures for the kind tier (`make e2e-kind`): the chart with mock GPUs on a kind
cluster of its own, built and run the way `make kind-up kind-install` does it.

``kind`` (session): deletes whatever an aborted run left of the cluster
``gpu-dra-e2e-kind``, then runs hack/kind/create-cluster.sh (1 control plane + 2
workers; on a machine without a registry the node image is built here),
build-and-load-image.sh and install.sh with a private KUBECONFIG. At the end, failed
or not, hack/kind/delete-cluster.sh deletes the cluster, and the teardown fails when any
container, volume or network of it is left on the host.

The tier is collected only with GPU_DRA_E2E_KIND=1 (what `make e2e-kind` sets): `make
test` runs the other tiers, and this one takes longer than `make test` may on 2 cores.
A missing tool or a failed step fails the tests and names it; nothing skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import E2E

REPO = Path(__file__).resolve().parents[2]
KIND_DIR = REPO / "hack" / "kind"
CLUSTER = "gpu-dra-e2e-kind"
WORKERS = 2
NETWORK = "gpu-dra-kind"
# A cold run builds kind, the Kubernetes binaries, the node image and the driver image.
KIND_TIMEOUT = 7200
ENABLED = os.environ.get("GPU_DRA_E2E_KIND") == "1"

collect_ignore_glob = [] if ENABLED else ["test_*.py"]


def pytest_report_header() -> str | None:
    if ENABLED:
        return None
    return "kind tier (tests/e2e_kind): not collected without GPU_DRA_E2E_KIND=1 (make e2e-kind)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.timeout(KIND_TIMEOUT))


@dataclass
class Kind:
    env: dict[str, str]
    e2e: E2E
    engine: str

    def script(
        self, name: str, *args: str, timeout: float = 1800
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(KIND_DIR / name), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def node_exec(self, node: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.engine, "exec", node, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def workers(self) -> list[str]:
        out = self.e2e.kubectl(
            "get", "nodes", "-l", "!node-role.kubernetes.io/control-plane", "-o", "name"
        ).stdout
        return sorted(line.removeprefix("node/") for line in out.split())


def _tail(text: str, lines: int = 80) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _sourced(env: dict[str, str], *names: str) -> list[str]:
    """Variables of hack/kind/common.sh as the scripts see them with `env`."""
    script = f"source {KIND_DIR / 'common.sh'} >/dev/null; " + "; ".join(
        f'printf "%s\\n" "${n}"' for n in names
    )
    proc = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"sourcing hack/kind/common.sh failed: {proc.stderr.strip()}")
    return proc.stdout.splitlines()


def leftovers(env: dict[str, str], engine: str) -> list[str]:
    """What the cluster left on the host: its containers, its nodes' volumes (Podman
    labels them with the node's name) and the network once no container uses it."""
    if shutil.which(engine) is None:
        return []

    def lines(*args: str) -> list[str]:
        proc = subprocess.run(
            [engine, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        return proc.stdout.split() if proc.returncode == 0 else []

    found = [
        f"container {c}"
        for c in lines("ps", "-a", "--filter", f"label=io.x-k8s.kind.cluster={CLUSTER}", "-q")
    ]
    if engine == "podman":
        nodes = [f"{CLUSTER}-control-plane", f"{CLUSTER}-worker"]
        nodes += [f"{CLUSTER}-worker{i}" for i in range(2, WORKERS + 1)]
        for node in nodes:
            found += [
                f"volume {v} ({node})"
                for v in lines("volume", "ls", "-q", "--filter", f"label={node}")
            ]
    users = lines("ps", "-a", "--filter", f"network={NETWORK}", "-q")
    if not users and NETWORK in lines("network", "ls", "--format", "{{.Name}}"):
        found.append(f"network {NETWORK}")
    return found


def _live(config: pytest.Config) -> AbstractContextManager[None]:
    """Lets the scripts' progress lines through pytest's capture (minutes-long steps)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    return capture.global_and_fixture_disabled() if capture else nullcontext()


def _run_step(config: pytest.Config, env: dict[str, str], name: str, *args: str) -> str:
    with _live(config):
        print(f"\n=== hack/kind/{name} {' '.join(args)}", flush=True)
        proc = subprocess.Popen(
            ["bash", str(KIND_DIR / name), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out = []
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()
        rc = proc.wait()
    text = "".join(out)
    if rc != 0:
        pytest.fail(f"hack/kind/{name} {' '.join(args)} exited {rc}:\n{_tail(text)}")
    return text


@pytest.fixture(scope="session")
def kind(pytestconfig: pytest.Config) -> Iterator[Kind]:
    tmp = Path(tempfile.mkdtemp(prefix="gpu-dra-e2e-kind."))
    env = {
        **os.environ,
        "KIND_CLUSTER_NAME": CLUSTER,
        "KIND_WORKERS": str(WORKERS),
        "KIND_NETWORK": NETWORK,
        "KUBECONFIG": str(tmp / "kubeconfig"),
    }
    engine, bin_dir = _sourced(env, "CONTAINER_TOOL", "BIN_DIR")
    stale = subprocess.run(
        ["bash", str(KIND_DIR / "delete-cluster.sh")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if stale.returncode != 0:
        pytest.fail(f"removing a stale {CLUSTER} failed:\n{_tail(stale.stdout + stale.stderr)}")
    try:
        _run_step(pytestconfig, env, "create-cluster.sh")
        _run_step(pytestconfig, env, "build-and-load-image.sh")
        _run_step(pytestconfig, env, "install.sh")
        helm = subprocess.run(
            ["bash", str(REPO / "hack" / "install-helm.sh"), "path"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        e = E2E(kubeconfig=tmp / "kubeconfig", bin_dir=Path(bin_dir), helm=helm)
        yield Kind(env=env, e2e=e, engine=engine)
    finally:
        down = subprocess.run(
            ["bash", str(KIND_DIR / "delete-cluster.sh")],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        left = leftovers(env, engine)
        shutil.rmtree(tmp, ignore_errors=True)
        if down.returncode != 0 or left:
            pytest.fail(
                f"cleanup of {CLUSTER}: delete-cluster.sh exited {down.returncode}, left on the "
                f"host: {left or 'nothing'}\n{_tail(down.stdout + down.stderr)}"
            )
