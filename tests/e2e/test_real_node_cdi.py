"""Complete CDI specs on the real node, with no NVIDIA runtime anywhere: the driver is
upgraded in place to name a fake driver installation on the node (tests/fake_driver.py:
ELF libraries with SONAMEs, binaries, firmware) as its driver root, so its CDI specs
carry the control and device nodes, the driver's files and NVIDIA's nvidia-cdi-hook
hooks exactly as on a GPU node; containerd injects them (CDI), the hooks run on the host
(the copy of nvidia-cdi-hook the plugin installed), runc creates the device nodes.

Shown from inside the containers: the driver's libraries are mounted, the hooks' soname
links exist and the libraries are in the container's ld cache; a MIG claim's container
has exactly its GPU's node and its MIG device's two capability nodes, a whole-GPU
claim's its GPU's node; NVIDIA_VISIBLE_DEVICES is void. Runs after test_partitions (file
name) and restores the demo values at the end.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import E2E, REPO, install_chart, mig_layout
from tests.fake_driver import CONTROL_NODES, DRIVER_VERSION, LIBRARIES, make_driver_root

FAKE_DRIVER = Path("/var/lib/gpu-dra-e2e-fake-driver")
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
NAMESPACE = "gpu-e2e-cdi"
SHOW = r"""
ls -ln /dev | grep -E ' nvidia' | sed 's/^/DEV /'
ls -ln /dev/nvidia-caps 2>/dev/null | grep nvidia-cap | sed 's/^/CAP /'
ls -l LIBDIR | sed 's/^/LIB /'
grep -c libcuda.so.1 /etc/ld.so.cache | sed 's/^/LDCACHE libcuda.so.1 /'
env | grep -E '^(NVIDIA_|GPU_DEVICE_)' | sort
trap 'exit 0' TERM; sleep 9999 & wait
""".replace("LIBDIR", LIB_DIR)


def _manifests() -> str:
    def pod(name: str, claim: str) -> dict[str, object]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"namespace": NAMESPACE, "name": name, "labels": {"app": "gpu-e2e-cdi"}},
            "spec": {
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "ctr0",
                        "image": "localhost/gpu-dra/busybox:1.35",
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", SHOW],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": claim}],
            },
        }

    def template(name: str, device_class: str, cel: str | None = None) -> dict[str, object]:
        request: dict[str, object] = {"deviceClassName": device_class}
        if cel:
            request["selectors"] = [{"cel": {"expression": cel}}]
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"namespace": NAMESPACE, "name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}},
        }

    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        template("whole", "gpu.example.com"),
        template(
            "mig",
            "mig.gpu.example.com",
            "device.attributes['gpu.example.com'].profile == '1g.10gb'",
        ),
        pod("whole", "whole"),
        pod("mig", "mig"),
    ]
    return yaml.safe_dump_all(docs)


def _standin() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "build-nvml-standin.sh")],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"hack/build-nvml-standin.sh failed:\n{proc.stderr}"
    return Path(lines[-1])


@pytest.fixture(scope="module")
def fake_driver_node(e2e: E2E, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    shutil.rmtree(FAKE_DRIVER, ignore_errors=True)
    make_driver_root(FAKE_DRIVER, _standin(), LIB_DIR, "/usr/bin")
    overlay = tmp_path_factory.mktemp("cdi") / "values.yaml"
    overlay.write_text(f"nvidiaDriverRoot: {FAKE_DRIVER}\n")
    manifests = tmp_path_factory.mktemp("cdi") / "pods.yaml"
    manifests.write_text(_manifests())
    try:
        install_chart(e2e, overlay, mig_layout)
        e2e.apply_file(manifests)
        yield e2e
    finally:
        e2e.delete_file(manifests)
        install_chart(e2e)  # back to the demo values the later tests expect
        shutil.rmtree(FAKE_DRIVER, ignore_errors=True)


def _log(e: E2E, pod: str) -> list[str]:
    e.wait_pods_ready(NAMESPACE, "app=gpu-e2e-cdi", 2)
    return e.kubectl("logs", "-n", NAMESPACE, pod, "-c", "ctr0").stdout.splitlines()


def _char_nodes(lines: list[str], prefix: str) -> dict[str, tuple[int, int]]:
    """`ls -ln` lines of character devices: name -> (major, minor)."""
    out = {}
    for line in lines:
        if line.startswith(prefix + " c"):
            fields = line.split()
            out[fields[-1]] = (int(fields[5].rstrip(",")), int(fields[6]))
    return out


def test_the_driver_files_and_hooks_reach_the_container(fake_driver_node: E2E) -> None:
    lines = _log(fake_driver_node, "whole")
    text = "\n".join(lines)
    libs = {
        line.split()[-3] if "->" in line else line.split()[-1]
        for line in lines
        if line.startswith("LIB ")
    }
    for name in LIBRARIES:
        assert f"{name}.{DRIVER_VERSION}" in libs, text
    # create-symlinks ran: the soname and development links NVIDIA's generator asked for.
    assert f"libcuda.so.1 -> libcuda.so.{DRIVER_VERSION}" in text, text
    assert "libcuda.so -> libcuda.so.1" in text, text
    # update-ldcache ran: ldconfig over the mounted directory put libcuda in the cache.
    ldcache = next(line for line in lines if line.startswith("LDCACHE"))
    assert int(ldcache.split()[-1]) >= 1, text
    assert "NVIDIA_VISIBLE_DEVICES=void" in lines, text
    nodes = _char_nodes(lines, "DEV")
    assert {f"nvidia{n}" for n in ("ctl", "-uvm", "-uvm-tools")} <= set(nodes), text
    assert set(CONTROL_NODES) - {"nvidia-modeset"} <= set(nodes), text
    gpus = [n for n in nodes if n.removeprefix("nvidia").isdigit()]
    assert len(gpus) == 1, text  # its own GPU only
    assert nodes[gpus[0]][0] == 195 and nodes["nvidiactl"] == (195, 255), text


def test_a_mig_claims_container_has_exactly_its_nodes(fake_driver_node: E2E) -> None:
    lines = _log(fake_driver_node, "mig")
    text = "\n".join(lines)
    nodes = _char_nodes(lines, "DEV")
    gpus = [n for n in nodes if n.removeprefix("nvidia").isdigit()]
    assert len(gpus) == 1, text
    caps = _char_nodes(lines, "CAP")
    assert len(caps) == 2 and all(major == 237 for major, _ in caps.values()), text
    assert any(line.startswith("GPU_DEVICE_") and "_UUID=MIG-" in line for line in lines), text
    # The claim's spec names the same capability minors as the mock kernel's MIG device.
    claim = fake_driver_node.get("resourceclaims", "-n", NAMESPACE)["items"]
    mig = [c for c in claim if c["metadata"]["name"].startswith("mig-")]
    assert mig and mig[0]["status"]["allocation"]["devices"]["results"][0]["device"].startswith(
        gpus[0].replace("nvidia", "gpu-") + "-mig-1g10gb-"
    ), (gpus, mig)
