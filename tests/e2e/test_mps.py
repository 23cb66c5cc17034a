"""MPS daemons as Deployments on the real kubelet (docs/mps.md): the driver upgraded
in place with kubeletPlugin.mps.enabled, a pod whose claim asks for MPS on an A100
40GB of values-demo.yaml (MIG off) on the mock. The claim's device gets a daemon
Deployment in the driver's namespace whose pod runs on the node with the mock driver
root's stand-in nvidia-cuda-mps-control and holds the claim's limits; the client
container sees CUDA_MPS_PIPE_DIRECTORY, the daemon's control socket through its pipe
mount and the daemon's shm directory at /dev/shm. The plugin's pod is deleted: the
daemon's pod keeps running (same UID, no restart), the new plugin adopts it, and the
client still reaches it. Deleting the pod unprepares the claim, which deletes the
Deployment and waits for its pod; so does a helm upgrade that replaces the plugin's
pod. demo/mps/cooperative-shares.yaml: two capacity shares
of one GPU, each limited by a daemon of its own with its share's memory and SMs (per
client process, for processes that use MPS). Back to the demo values at the end."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, wait_for
from tests.e2e.conftest import DRIVER, E2E, NAMESPACE, install_chart

NS = "gpu-e2e-mps"
LABEL = f"{DRIVER}/mps-daemon"
PIPE = "/tmp/nvidia-mps"
# An A100 40GB of values-demo.yaml: MIG off (MPS is refused on a MIG device).
SELECTOR = "device.attributes['gpu.example.com'].productName == 'NVIDIA A100-SXM4-40GB'"
CLIENT_SCRIPT = (
    f"env | grep -E '^CUDA_MPS' | sort; grep -E ' ({PIPE}|/dev/shm) ' /proc/mounts; "
    "trap 'exit 0' TERM; sleep 9999 & wait"
)


def _client_manifest(
    namespace: str,
    pod: str,
    script: str,
    mps_config: dict[str, Any],
    *,
    run_as: int | None = None,
) -> str:
    """A namespace, a claim template asking MPS of an A100 (`mps_config`) and a pod
    `pod` (label app=mps-<pod>) of busybox running `script` with the claim. `run_as`: a
    non-root uid, the namespace enforcing Pod Security `restricted` and the pod
    meeting it."""
    namespace_doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": namespace},
    }
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "gpu.example.com",
            "selectors": [{"cel": {"expression": SELECTOR}}],
        },
    }
    parameters = {
        "apiVersion": "gpu.resource.example.com/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": mps_config},
    }
    config = {
        "requests": ["gpu"],
        "opaque": {"driver": "gpu.example.com", "parameters": parameters},
    }
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"namespace": namespace, "name": "mps-gpu"},
        "spec": {"spec": {"devices": {"requests": [request], "config": [config]}}},
    }
    container: dict[str, Any] = {
        "name": "ctr0",
        "image": "localhost/gpu-dra/busybox:1.35",
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
        "resources": {"claims": [{"name": "gpu"}]},
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "mps-gpu"}],
    }
    if run_as is not None:
        namespace_doc["metadata"]["labels"] = {"pod-security.kubernetes.io/enforce": "restricted"}
        pod_spec["securityContext"] = {
            "runAsNonRoot": True,
            "runAsUser": run_as,
            "runAsGroup": run_as,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
    pod_doc = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": pod, "labels": {"app": f"mps-{pod}"}},
        "spec": pod_spec,
    }
    return yaml.safe_dump_all([namespace_doc, template, pod_doc])


CLIENT = _client_manifest(
    NS,
    "client",
    CLIENT_SCRIPT,
    {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "4Gi"},
)


def _daemons(e: E2E) -> list[dict[str, Any]]:
    return list(e.get("deployments", "-n", NAMESPACE, "-l", LABEL)["items"])


def _daemon_pods(e: E2E) -> list[dict[str, Any]]:
    return list(e.get("pods", "-n", NAMESPACE, "-l", LABEL)["items"])


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@pytest.fixture(scope="module")
def mps(e2e: E2E) -> Iterator[E2E]:
    with tempfile.TemporaryDirectory() as tmp:
        overlay = Path(tmp) / "mps.yaml"
        overlay.write_text(yaml.safe_dump({"kubeletPlugin": {"mps": {"enabled": True}}}))
        install_chart(e2e, overlay)
    try:
        yield e2e
    finally:
        e2e.kubectl("delete", "namespace", NS, "--ignore-not-found", "--timeout=120s", check=False)
        install_chart(e2e)  # back to the demo values the later tests expect


def test_the_daemon_deployment_outlives_a_plugin_restart_and_goes_with_the_claim(
    mps: E2E,
) -> None:
    e = mps
    env = {x["name"]: x for x in e.plugin_pod()["spec"]["containers"][0]["env"]}
    assert env["MPS_DAEMONS"]["value"] == "kubernetes", env.get("MPS_DAEMONS")
    e.kubectl("apply", "-f", "-", input=CLIENT)
    (client,) = e.wait_pods_ready(NS, "app=mps-client", 1)

    # The claim's daemon: one Deployment, its pod ready on the client's node.
    (deployment,) = _daemons(e)
    (daemon,) = [p for p in _daemon_pods(e) if p["metadata"].get("deletionTimestamp") is None]
    assert _ready(daemon), daemon["status"]
    assert daemon["spec"]["nodeName"] == client["spec"]["nodeName"]
    assert daemon["spec"]["hostPID"] is True
    (container,) = daemon["spec"]["containers"]
    assert container["image"] == e.plugin_pod()["spec"]["containers"][0]["image"]
    assert "--active-thread-percentage=50" in container["command"], container["command"]
    root = _command_value(daemon, "--driver-root")
    daemon_name = daemon["metadata"]["name"]

    def ask(line: str) -> str:
        return _ask(e, daemon, line)

    mock_binary = e.kubectl(
        "exec", "-n", NAMESPACE, daemon_name, "--", "cat", f"{root}/usr/bin/nvidia-cuda-mps-control"
    ).stdout
    assert "driver.nvml.mock.mps_control" in mock_binary, mock_binary
    assert ask("get_default_active_thread_percentage") == "50.0"
    assert ask("get_default_device_pinned_mem_limit 0") == "4096M"

    # The client: the pipe directory (with the daemon's control socket) and /dev/shm.
    log = e.kubectl("logs", "-n", NS, "client", "-c", "ctr0").stdout
    lines = log.splitlines()
    assert f"CUDA_MPS_PIPE_DIRECTORY={PIPE}" in lines, log
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in lines, log
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M" in lines, log
    assert any(f" {PIPE} " in line for line in lines), log
    assert any(" /dev/shm " in line for line in lines), log

    def client_sees_the_daemon() -> str:
        return e.kubectl("exec", "-n", NS, "client", "--", "ls", PIPE).stdout

    assert "control" in client_sees_the_daemon().split()

    # The plugin's pod is deleted (its DaemonSet starts another): the daemon stays.
    old_plugin = e.plugin_pod()["metadata"]["uid"]
    e.kubectl("delete", "pod", "-n", NAMESPACE, e.plugin_pod()["metadata"]["name"], "--wait=true")
    wait_for(
        lambda: e.plugin_pod()["metadata"]["uid"] != old_plugin and _ready(e.plugin_pod()),
        300,
        "a new Ready plugin pod",
    )
    (after,) = [p for p in _daemon_pods(e) if p["metadata"].get("deletionTimestamp") is None]
    assert after["metadata"]["uid"] == daemon["metadata"]["uid"], "the daemon's pod was replaced"
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0, after["status"]
    assert [d["metadata"]["uid"] for d in _daemons(e)] == [deployment["metadata"]["uid"]]
    plugin_log = e.kubectl(
        "logs", "-n", NAMESPACE, e.plugin_pod()["metadata"]["name"], "-c", "plugin"
    ).stdout
    assert "is gone; starting it again" not in plugin_log, plugin_log[-3000:]
    assert ask("get_default_device_pinned_mem_limit 0") == "4096M"
    assert "control" in client_sees_the_daemon().split()
    assert e.get("pod", "-n", NS, "client")["status"]["phase"] == "Running"

    # A helm upgrade that replaces the plugin's pod (a changed pod template): the same.
    before_upgrade = e.plugin_pod()["metadata"]["uid"]
    with tempfile.TemporaryDirectory() as tmp:
        overlay = Path(tmp) / "upgrade.yaml"
        values = {"mps": {"enabled": True}, "podAnnotations": {"e2e/upgraded": "yes"}}
        overlay.write_text(yaml.safe_dump({"kubeletPlugin": values}))
        install_chart(e, overlay)
    wait_for(
        lambda: e.plugin_pod()["metadata"]["uid"] != before_upgrade and _ready(e.plugin_pod()),
        300,
        "the upgraded plugin pod to be Ready",
    )
    (upgraded,) = [p for p in _daemon_pods(e) if p["metadata"].get("deletionTimestamp") is None]
    assert upgraded["metadata"]["uid"] == daemon["metadata"]["uid"], "the upgrade replaced it"
    assert upgraded["status"]["containerStatuses"][0]["restartCount"] == 0, upgraded["status"]
    assert ask("get_default_device_pinned_mem_limit 0") == "4096M"
    assert "control" in client_sees_the_daemon().split()

    # Unprepare: the pod and its claim go; so do the Deployment and its pod.
    e.kubectl("delete", "pod", "-n", NS, "client", "--wait=true", "--timeout=120s")
    wait_for(
        lambda: not _daemons(e) and not _daemon_pods(e),
        120,
        "the daemon's Deployment and pod to be deleted at unprepare",
    )
    claims = e.get("resourceclaims", "-n", NS)["items"]
    assert claims == [] or all(c["metadata"].get("deletionTimestamp") for c in claims), json.dumps(
        claims
    )[:2000]


def _command_value(pod: dict[str, Any], flag: str) -> str:
    (container,) = pod["spec"]["containers"]
    return next(a.split("=", 1)[1] for a in container["command"] if a.startswith(f"{flag}="))


def _ask(e: E2E, daemon: dict[str, Any], line: str) -> str:
    """The stand-in nvidia-cuda-mps-control, run in the daemon's pod, asked `line`."""
    pipe = _command_value(daemon, "--pipe-directory")
    root = _command_value(daemon, "--driver-root")
    script = f"echo {line} | CUDA_MPS_PIPE_DIRECTORY={pipe} {root}/usr/bin/nvidia-cuda-mps-control"
    name = daemon["metadata"]["name"]
    return e.kubectl("exec", "-n", NAMESPACE, name, "--", "sh", "-c", script).stdout.strip()


def test_two_shares_of_one_gpu_are_limited_by_daemons_of_their_own(mps: E2E) -> None:
    """demo/mps/cooperative-shares.yaml, as `make demo` runs it: no MPS strategy in the
    claims, only capacity requests on a device with `mpsIsolation: "cooperative"`."""
    e = mps
    example = REPO / "demo" / "mps" / "cooperative-shares.yaml"
    e.kubectl("apply", "-f", str(example))
    try:
        pods = e.wait_pods_ready("gpu-demo-mps", "app=gpu-demo", 2)
        envs = {
            p["metadata"]["name"]: e.kubectl(
                "logs", "-n", "gpu-demo-mps", p["metadata"]["name"], "-c", "ctr0"
            ).stdout.splitlines()
            for p in pods
        }
        gpus = {n: sorted(x for x in env if "=gpu-" in x) for n, env in envs.items()}
        assert gpus["pod0"] == gpus["pod1"] and gpus["pod0"], gpus  # one GPU, two shares
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=16384M" in envs["pod0"], envs
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20" in envs["pod0"], envs
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M" in envs["pod1"], envs
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in envs["pod1"], envs

        daemons = [p for p in _daemon_pods(e) if p["metadata"].get("deletionTimestamp") is None]
        assert len(daemons) == 2 and all(_ready(p) for p in daemons), daemons
        held = {
            (
                _ask(e, daemon, "get_default_active_thread_percentage"),
                _ask(e, daemon, "get_default_device_pinned_mem_limit 0"),
            )
            for daemon in daemons
        }
        assert held == {("20.0", "16384M"), ("50.0", "8192M")}, held
    finally:
        e.kubectl("delete", "-f", str(example), "--wait=true", "--timeout=120s", check=False)
    wait_for(
        lambda: not _daemons(e) and not _daemon_pods(e),
        120,
        "the shares' daemons to be deleted at unprepare",
    )


NON_ROOT_NS = "gpu-e2e-mps-nonroot"
TENANT_UID = 1000
TENANT_SCRIPT = (
    "id -u; stat -c '%n %a' /dev/shm /tmp/nvidia-mps; "
    "touch /dev/shm/tenant && echo shm-writable; "
    "touch /tmp/nvidia-mps/tenant && echo pipe-writable; "
    "ls /tmp/nvidia-mps; "
    "rm -f /tmp/nvidia-mps/nvidia-cuda-mps-control.pid 2>&1 && echo pid-removed || echo pid-kept; "
    "echo \"top $(grep ' /dev/shm ' /proc/mounts | tail -1)\"; "
    "trap 'exit 0' TERM; sleep 9999 & wait"
)
NON_ROOT_CLIENT = _client_manifest(
    NON_ROOT_NS, "tenant", TENANT_SCRIPT, {"defaultActiveThreadPercentage": 50}, run_as=TENANT_UID
)


def test_a_non_root_restricted_pod_writes_its_shm_and_pipe_but_not_the_daemons_files(
    mps: E2E,
) -> None:
    """Issue 44, items 5 and 6 (docs/mps.md, "Directories, users and /dev/shm"): a pod
    of a namespace that enforces Pod Security `restricted`, running as uid 1000, gets
    a /dev/shm and a pipe directory it can write (1777), cannot remove the daemon's
    pid file there (the sticky bit), and its /dev/shm is the plugin's tmpfs, or, where
    the plugin may not mount one (the mock's unprivileged plugin), the plugin's log
    says that it stays a plain directory."""
    e = mps
    e.kubectl("apply", "-f", "-", input=NON_ROOT_CLIENT)
    try:
        e.wait_pods_ready(NON_ROOT_NS, "app=mps-tenant", 1)
        (daemon,) = [p for p in _daemon_pods(e) if p["metadata"].get("deletionTimestamp") is None]
        assert _ready(daemon), daemon["status"]

        def logged() -> str | None:
            text = e.kubectl("logs", "-n", NON_ROOT_NS, "tenant", "-c", "ctr0").stdout
            return text if "top " in text else None

        log = wait_for(logged, 60, "the tenant's checks in its log")
        lines = log.splitlines()
        assert lines[0] == str(TENANT_UID), log
        assert "/dev/shm 1777" in lines and "/tmp/nvidia-mps 1777" in lines, log
        assert "shm-writable" in lines and "pipe-writable" in lines, log
        assert "control" in log.split() and "pid-kept" in lines, log
        assert "pid-removed" not in lines, log
        (top,) = [line for line in lines if line.startswith("top ")]
        if top.split()[3:4] != ["tmpfs"]:  # `top <source> /dev/shm <type> ...`
            plugin_log = e.kubectl(
                "logs", "-n", NAMESPACE, e.plugin_pod()["metadata"]["name"], "-c", "plugin"
            ).stdout
            assert "/dev/shm directories are not bounded" in plugin_log, (top, plugin_log[-3000:])
        assert _ask(e, daemon, "get_default_active_thread_percentage") == "50.0"
    finally:
        e.kubectl("delete", "namespace", NON_ROOT_NS, "--wait=true", "--timeout=120s", check=False)
    wait_for(
        lambda: not _daemons(e) and not _daemon_pods(e),
        120,
        "the tenant's daemon to be deleted at unprepare",
    )
