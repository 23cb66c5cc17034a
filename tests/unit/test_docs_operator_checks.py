"""The checks the operator docs have users run work where they are run: the install
check's pods need no image from outside the cluster's registry (air-gapped clusters),
the install guides show how to see that the DaemonSet matched no node, and the
runbook's `allocatedResourcesStatus` jsonpaths print a pod's device health (run with
the project's kubectl, offline, over a pod status as the kubelet writes it)."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
INSTALL_GUIDES = (REPO / "README.md", DOCS / "install.md", DOCS / "troubleshooting.md")
DRIVER_IMAGE = re.compile(r"^\S+/gpu-dra-driver:\S+$")


def yaml_blocks(markdown: str) -> list[str]:
    return re.findall(r"^\s*```yaml\n(.*?)^\s*```", markdown, re.M | re.S)


def pods(path: Path) -> list[dict[str, Any]]:
    found = []
    for block in yaml_blocks(path.read_text()):
        found += [
            d
            for d in yaml.safe_load_all(textwrap.dedent(block))
            if isinstance(d, dict) and d.get("kind") == "Pod"
        ]
    return found


@pytest.mark.parametrize("guide", INSTALL_GUIDES, ids=lambda p: p.name)
def test_install_check_pods_use_the_drivers_own_image(guide: Path) -> None:
    for pod in pods(guide):
        for container in pod["spec"]["containers"]:
            assert DRIVER_IMAGE.match(container["image"]), (guide.name, container["image"])


def test_the_install_check_has_a_pod() -> None:
    assert pods(DOCS / "troubleshooting.md")


@pytest.mark.parametrize("guide", (REPO / "README.md", DOCS / "install.md"), ids=lambda p: p.name)
def test_install_shows_how_to_see_that_no_node_matched(guide: Path) -> None:
    text = guide.read_text()
    assert "kubectl -n gpu-dra-driver get daemonset" in text
    assert "DESIRED" in text and "2. Node selection" in text


# -- the runbook's allocatedResourcesStatus ---------------------------------------------


def kubectl() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "local-cluster.sh"), "bin-dir"],
        capture_output=True,
        text=True,
        check=False,
    )
    path = Path(proc.stdout.strip()) / "kubectl"
    if proc.returncode != 0 or not path.is_file():
        pytest.fail("no kubectl built: run hack/local-cluster.sh build (make test does)")
    return path


POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "train-0", "namespace": "ml"},
    "spec": {"containers": [{"name": "trainer", "image": "x"}]},
    "status": {
        "containerStatuses": [
            {
                "name": "trainer",
                "allocatedResourcesStatus": [
                    {
                        "name": "claim:train-0-gpu-x7k2q/gpu",
                        "resources": [
                            {
                                "resourceID": "gpu.example.com/node-1/gpu-3",
                                "health": "Unhealthy",
                                "message": "Xid 79 (since 2026-11-28T07:02:11Z)",
                            }
                        ],
                    }
                ],
            }
        ]
    },
}


def runbook_jsonpaths() -> list[str]:
    text = (DOCS / "gpu-failure-runbook.md").read_text()
    return [
        p for p in re.findall(r"-o jsonpath='([^']*)'", text) if "allocatedResourcesStatus" in p
    ]


def test_the_runbook_reads_the_pods_allocated_resources_status(tmp_path: Path) -> None:
    paths = runbook_jsonpaths()
    assert len(paths) == 2, paths  # one pod; every pod of the cluster
    pod_file = tmp_path / "pod.json"
    pod_file.write_text(json.dumps(POD))
    for path in paths:
        # kubectl applies a `get pods -A` path to a List: run its per-item part on the pod.
        if path.startswith("{range .items[*]}"):
            path = path.removeprefix("{range .items[*]}").removesuffix("{end}")
        path = f"jsonpath={path}"
        proc = subprocess.run(
            [str(kubectl()), "annotate", "--local", "-f", str(pod_file), "x=y", "-o", path],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert "gpu.example.com/node-1/gpu-3" in proc.stdout and "Unhealthy" in proc.stdout
    text = (DOCS / "gpu-failure-runbook.md").read_text()
    assert "claim:<claim>/<request>" in text and "ResourceHealthStatus" in text
