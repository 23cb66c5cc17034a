"""`gpu-dra health --all-nodes` over an API server's ResourceSlices (a local HTTP server
that answers the list as the API server does: field selector, pages), and the per-GPU
summary of `gpu-dra health` on one node."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

from driver.cli import main

DRIVER = "gpu.example.com"
XID = {"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}
RESET = {"key": f"{DRIVER}/recovery-action", "value": "gpu-reset", "effect": "NoSchedule"}
UNMONITORED = {"key": f"{DRIVER}/unmonitored", "effect": "None"}


def gpu(minor: int, *taints: dict[str, Any], since: str = "2026-11-27T10:00:00Z") -> list[Any]:
    """A MIG-capable GPU as the plugin publishes it: the whole GPU and 26 partitions,
    each carrying the GPU's taints."""
    uuid = f"GPU-{minor:04d}"
    stamped = [{**t, "timeAdded": since} for t in taints]
    whole = {
        "name": f"gpu-{minor}",
        "attributes": {"uuid": {"string": uuid}, "parentUUID": {"string": uuid}},
        "taints": stamped,
    }
    parts = [
        {
            "name": f"gpu-{minor}-mig-{i}",
            "attributes": {"parentUUID": {"string": uuid}, "profile": {"string": "1g.10gb"}},
            "taints": stamped,
        }
        for i in range(26)
    ]
    return [whole, *parts]


def slice_doc(node: str, index: int, devices: list[Any], generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}-{index}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


class SliceServer(http.server.BaseHTTPRequestHandler):
    """Lists `slices` filtered by `spec.driver`/`spec.nodeName`, `limit` per page."""

    slices: ClassVar[list[dict[str, Any]]] = []
    pages: ClassVar[int] = 0

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        wanted = dict(f.split("=", 1) for f in query.get("fieldSelector", "").split(",") if f)
        matched = [
            s
            for s in self.slices
            if all(
                s["spec"].get(field.removeprefix("spec.")) == value
                for field, value in wanted.items()
            )
        ]
        start = int(query.get("continue") or 0)
        end = start + int(query.get("limit") or len(matched) or 1)
        metadata = {"continue": str(end)} if end < len(matched) else {}
        SliceServer.pages += 1
        payload = json.dumps({"items": matched[start:end], "metadata": metadata}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    SliceServer.slices, SliceServer.pages = [], 0
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SliceServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [
                    {"name": "k", "cluster": {"server": f"http://127.0.0.1:{httpd.server_port}"}}
                ],
                "users": [{"name": "u", "user": {}}],
            }
        )
    )
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HTTP_PORT", "1")
    yield path
    httpd.shutdown()
    httpd.server_close()


def fleet() -> list[dict[str, Any]]:
    """node-b: gpu-3 Xid 79 and a gpu-reset action, gpu-10 unmonitored; node-a: gpu-1
    Xid 79 (generation 2; generation 1 still lists gpu-0 tainted); node-c healthy;
    another driver's tainted slice."""
    return [
        slice_doc("node-b", 0, gpu(2) + gpu(3, XID, RESET) + gpu(10, UNMONITORED)),
        slice_doc("node-a", 0, gpu(0, XID), generation=1),
        slice_doc("node-a", 1, gpu(0) + gpu(1, XID, since="2026-11-26T08:00:00Z"), generation=2),
        slice_doc("node-c", 0, gpu(0)),
        {**slice_doc("node-c", 9, gpu(7, XID)), "spec": {"driver": "other.example.com"}},
    ]


def test_all_nodes_lists_one_line_per_tainted_gpu_sorted_by_node(
    kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    SliceServer.slices = fleet()
    code = main(["health", "--all-nodes", "--kubeconfig", str(kubeconfig)])
    out = capsys.readouterr().out
    assert code == 0
    header, *rows, total = [line for line in out.splitlines() if line]
    assert header.split() == ["NODE", "GPU", "DEVICES", "TAINTS", "SINCE"]
    assert [row.split()[:3] for row in rows] == [
        ["node-a", "gpu-1", "27/27"],
        ["node-b", "gpu-3", "27/27"],
        ["node-b", "gpu-10", "27/27"],
    ]
    assert f"{DRIVER}/xid=79:NoSchedule" in rows[0] and "2026-11-26T08:00:00Z" in rows[0]
    assert f"{DRIVER}/recovery-action=gpu-reset:NoSchedule, {DRIVER}/xid=79:NoSchedule" in rows[1]
    assert f"{DRIVER}/unmonitored:None" in rows[2]
    assert total.startswith("3 tainted GPU(s), 2 unhealthy, of 6 GPU(s) on 3 node(s)")


def test_all_nodes_json_and_fail_on_unhealthy(
    kubeconfig: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    SliceServer.slices = fleet()
    args = ["health", "--all-nodes", "--kubeconfig", str(kubeconfig), "-o", "json"]
    assert main([*args, "--fail-on-unhealthy"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["nodes"], report["gpus"], report["unhealthyGPUs"]) == (3, 6, 2)
    first = report["taintedGPUs"][0]
    assert (first["node"], first["gpu"], first["gpuUUID"], first["unhealthy"]) == (
        "node-a",
        "gpu-1",
        "GPU-0001",
        True,
    )
    assert first["taints"] == [
        {**XID, "timeAdded": "2026-11-26T08:00:00Z", "devices": 27},
    ]
    unmonitored = report["taintedGPUs"][2]
    assert (unmonitored["gpu"], unmonitored["unhealthy"]) == ("gpu-10", False)

    # Unmonitored only (health unknown, not bad): --fail-on-unhealthy passes.
    SliceServer.slices = [slice_doc("node-b", 0, gpu(10, UNMONITORED))]
    assert main([*args, "--fail-on-unhealthy"]) == 0


def test_all_nodes_reads_every_page(
    kubeconfig: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from driver.cli import published

    SliceServer.slices = [slice_doc(f"node-{i:03d}", 0, gpu(0, XID)) for i in range(7)]
    monkeypatch.setattr(published, "PAGE_SIZE", 3)
    main(["health", "--all-nodes", "--kubeconfig", str(kubeconfig), "-o", "json"])
    report = json.loads(capsys.readouterr().out)
    assert [g["node"] for g in report["taintedGPUs"]] == [f"node-{i:03d}" for i in range(7)]
    assert SliceServer.pages == 3


def test_all_nodes_without_an_api_server_says_why_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["health", "--all-nodes"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpu-dra health --all-nodes: no API server configured")
    assert err.count("\n") == 1


def test_fail_on_unhealthy_needs_all_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["health", "--fail-on-unhealthy", "--state-dir", str(tmp_path)]) == 2
    assert "--fail-on-unhealthy goes with --all-nodes" in capsys.readouterr().err


def test_node_health_summarises_a_failed_gpu_on_one_line(
    kubeconfig: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One failed H100 (27 devices) is one slice line by default; --devices lists all."""
    SliceServer.slices = fleet()
    args = ["health", "--kubeconfig", str(kubeconfig), "--node-name", "node-b"]
    args += ["--state-dir", str(tmp_path), "--socket", str(tmp_path / "none.sock")]
    assert main(args) == 0
    out = capsys.readouterr().out
    slice_rows = [line for line in out.splitlines() if line.startswith("slices ")]
    assert [row.split()[:2] for row in slice_rows] == [["slices", "gpu-3"], ["slices", "gpu-10"]]
    assert "gpu-3 (27 of 27 devices)" in slice_rows[0]
    assert "slices: 2 tainted GPU(s) on node node-b (" in out
    assert "): 81 device taint(s) (--devices lists them)" in out

    assert main([*args, "--devices"]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("slice ")]) == 81
