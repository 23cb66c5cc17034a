"""The API server stopped and restarted while the kubelet keeps calling the plugin.

The kube-apiserver of the test cluster is killed by its pid file; meanwhile prepare
calls keep coming (each must answer a transient error naming the claim it could not
read, never hang or crash the plugin; every unprepare succeeds, it needs no API) and a
GPU fails (a mock Xid), so the slices have to change while nobody can write them.
`hack/local-cluster.sh up` (idempotent: it restarts what is not running) brings the
control plane back; then the slices must converge to the taint, prepare must work
again, a claim on the failed GPU must be answered `permanent (device-failed)` with an
Event on it, and the reset must clear the taint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

from driver.cli.mock import submit
from driver.kube.api import KubeApi
from driver.nvml.mock.mock_control import MockRequest
from driver.proto.dra.v1 import api_pb2
from tests.conftest import SCRIPT, Cluster, FakeNode
from tests.integration.helpers import complete_pool, published_devices
from tests.integration.kubelet_standin import PREPARE_TIMEOUT, ClaimRef
from tests.integration.plugin_process import DRIVER
from tests.reliability.support import (
    allocated_claim,
    api_for,
    assert_consistent,
    ensure_namespace,
    start_instance,
)

NS = "reliability-api"
OUTAGE_SECONDS = 6.0


def _run_dir_and_env(cluster: Cluster) -> tuple[Path, dict[str, str]]:
    """The cluster's run dir and the script environment that names it (a cluster from
    GPU_DRA_KUBECONFIG counts if its kubeconfig sits in a local-cluster run dir)."""
    run_dir = cluster.run_dir or cluster.kubeconfig.parent
    ports = run_dir / "ports.env"
    assert (run_dir / "pids").is_dir() and ports.is_file(), (
        f"{run_dir} is not a hack/local-cluster.sh run dir: cannot stop its API server"
    )
    env = {"GPU_DRA_CLUSTER_DIR": str(run_dir)}
    for line in ports.read_text().splitlines():
        key, _, value = line.partition("=")
        if key:
            env[key] = value
    return run_dir, {**env, **cluster.env}


def _taint(cluster: Cluster, node: str, device: str) -> list[dict[str, object]] | None:
    pool = complete_pool(cluster, node)
    if not pool:
        return None
    taints: list[dict[str, object]] = published_devices(pool)[device].get("taints") or []
    return taints


def _events(api: KubeApi, ref: ClaimRef) -> list[str]:
    """Messages of the driver's PermanentPrepareFailure Events on the claim."""
    events = api.request(
        "GET",
        f"/api/v1/namespaces/{ref.namespace}/events",
        query={"fieldSelector": f"involvedObject.uid={ref.uid}"},
    )["items"]
    return [e["message"] for e in events if e["reason"] == "PermanentPrepareFailure"]


def test_api_server_down_and_back_under_load(
    cluster: Cluster, node: FakeNode, root: Path, figures: Counter[str]
) -> None:
    run_dir, env = _run_dir_and_env(cluster)
    api = api_for(cluster)
    ensure_namespace(api, NS)
    refs = [allocated_claim(api, node.name, NS, f"api-{i}", f"gpu-{i}") for i in range(2)]
    on_failing_gpu = allocated_claim(api, node.name, NS, "api-failing", "gpu-5")
    inst = start_instance(cluster, node, root)
    try:
        cluster.wait_for(lambda: complete_pool(cluster, node.name), 60, "pool published")
        # gpu-5 works before the outage.
        before = inst.kubelet.prepare(DRIVER, [on_failing_gpu])[on_failing_gpu.uid]
        assert before.error == "", before.error
        assert inst.kubelet.unprepare(DRIVER, [on_failing_gpu])[on_failing_gpu.uid].error == ""
        errors: list[tuple[ClaimRef, str]] = []
        calls = Counter[str]()
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                for ref in refs:
                    # answered within the kubelet's own call timeout, or this raises
                    res = inst.kubelet.prepare(DRIVER, [ref], timeout=PREPARE_TIMEOUT)[ref.uid]
                    calls["calls"] += 1
                    if res.error:
                        errors.append((ref, res.error))
                        assert res.error_type != api_pb2.Permanent, res.error
                    # Unprepare is local (journal and CDI spec): it succeeds even while
                    # the API server is down.
                    gone = inst.kubelet.unprepare(DRIVER, [ref], timeout=PREPARE_TIMEOUT)[ref.uid]
                    assert gone.error == "", f"unprepare of {ref.name}: {gone.error}"
                    calls["unprepares"] += 1
                time.sleep(0.05)

        failures: list[BaseException] = []

        def guarded() -> None:
            try:
                load()
            except BaseException as err:
                failures.append(err)

        worker = threading.Thread(target=guarded, daemon=True)
        worker.start()
        time.sleep(1.0)

        pid = int((run_dir / "pids" / "kube-apiserver.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        figures["api restart: kube-apiserver SIGKILLs"] += 1
        time.sleep(0.5)
        # A GPU fails while nobody can write slices.
        submit(inst.plugin.data_dir, MockRequest(action="xid", device="gpu-5", xid=79))
        time.sleep(OUTAGE_SECONDS)
        inst.plugin.check_alive()

        up = subprocess.run(
            ["bash", str(SCRIPT), "up"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert up.returncode == 0, f"local-cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
        assert not failures, failures[0]  # the load loop's answers during the outage

        # The slices converge to the failure that happened during the outage.
        taints = cluster.wait_for(
            lambda: _taint(cluster, node.name, "gpu-5"), 90, "taint of gpu-5 published"
        )
        assert taints[0]["key"] == f"{DRIVER}/xid" and taints[0]["value"] == "79", taints
        # Prepare works again (the load loop keeps going for a few calls).
        done = calls["calls"]
        cluster.wait_for(
            lambda: failures or calls["calls"] >= done + 4, 60, "prepare calls after restart"
        )
        stop.set()
        worker.join(timeout=60)
        assert not failures, failures[0]
        figures["api restart: prepare calls under load"] += calls["calls"]
        figures["api restart: clear transient errors while down"] += len(errors)
        figures["api restart: unprepare answers checked"] += calls["unprepares"]
        assert errors, "no call noticed the API server outage"
        for ref, message in errors:  # the claim read is the only step that needs the API
            assert message.startswith(f"reading ResourceClaim {NS}/{ref.name}: "), message

        # The GPU that failed during the outage: permanent device-failed, its taint
        # accepted first (published above), an Event on the claim.
        failed = inst.kubelet.prepare(DRIVER, [on_failing_gpu])[on_failing_gpu.uid]
        assert failed.error_type == api_pb2.Permanent, failed.error
        assert failed.error.startswith(
            f"permanent (device-failed): allocated device(s) unusable for claim "
            f"{NS}/{on_failing_gpu.name}: gpu-5: Xid 79"
        ), failed.error
        assert not failed.devices
        assert _events(api, on_failing_gpu) == [failed.error]
        assert inst.kubelet.unprepare(DRIVER, [on_failing_gpu])[on_failing_gpu.uid].error == ""

        last = refs[-1]
        assert inst.kubelet.prepare(DRIVER, [last])[last.uid].error == ""
        assert_consistent(inst.plugin, {last.uid})
        assert inst.kubelet.unprepare(DRIVER, [last])[last.uid].error == ""

        submit(inst.plugin.data_dir, MockRequest(action="reset", device="gpu-5"))
        cluster.wait_for(
            lambda: _taint(cluster, node.name, "gpu-5") == [], 60, "taint of gpu-5 cleared"
        )
        pool = complete_pool(cluster, node.name)
        assert pool and len(published_devices(pool)) == inst.plugin.metric(
            "gpu_dra_published_devices"
        )
        inst.plugin.check_alive()
        assert_consistent(inst.plugin, set())
    finally:
        inst.stop()
