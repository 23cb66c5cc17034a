"""The chart's NetworkPolicies, enforced. The offline cluster's bridge CNI enforces
none, so hack/kind/network-policies.sh (run by create-cluster.sh) puts
kube-network-policies, the implementation kind's kindnetd embeds, on every node.

hack/kind/install.sh installs the chart with both policies and their peers:
  * the plugin's metrics port (8080) admits a Prometheus: pods labelled
    app.kubernetes.io/name=prometheus in namespace monitoring;
  * the webhook port (8443) admits the control-plane node's address (the API server).

Two client pods on the first worker (busybox, already loaded into the nodes): the
"scraper" in namespace monitoring, admitted to the metrics port, and the "outsider",
with the same label in another namespace, admitted nowhere. Each connection attempt is
`nc -w 3 IP PORT` in the pod (bounded again by `timeout 8`): a blocked one times out
(the daemon drops the SYN); it is not refused. The targets are both plugin pods (one on
the clients' node, through the bridge; one on the other worker, routed) and the webhook
(its pods and its Service).

The first test checks that the daemon runs and receives the traffic; the last is the
control: with the daemon deleted (the node still steering packets to its queue, which
then lets them pass) the same outsider connects to every target; with the daemon back
it is blocked again.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.conftest import DRIVER, wait_for
from tests.e2e_kind.conftest import Kind, _tail

DRIVER_NS = "gpu-dra-driver"
RELEASE = "gpu-dra-driver"
PLUGIN = "app.kubernetes.io/component=kubeletplugin"
WEBHOOK = "app.kubernetes.io/component=webhook"
# hack/kind/network-policies.sh
DAEMON = "gpu-dra-network-policies"
DAEMON_NS = "kube-system"
DAEMON_METRICS = 9080
TABLE = "kube-network-policies"
CHAIN = "GPU-DRA-KNP"
QUEUE = 100
METRICS_PORT = 8080
WEBHOOK_PORT = 8443
# The admitted set of kubeletPlugin.metrics.networkPolicy.from (hack/kind/install.sh).
SCRAPER_NS = "monitoring"
OUTSIDE_NS = "gpu-dra-netpol-outside"
CLIENT_LABEL = {"app.kubernetes.io/name": "prometheus"}
BUSYBOX = "localhost/gpu-dra/busybox:1.35"


@dataclass(frozen=True)
class Target:
    what: str
    ip: str
    port: int


@dataclass
class Clients:
    node: str
    plugins: list[Target]  # the metrics port of each plugin pod
    webhook: list[Target]  # the webhook pods' port and the webhook Service


def _client_pod(namespace: str, node: str) -> str:
    labels = "".join(f"\n    {k}: {v}" for k, v in CLIENT_LABEL.items())
    return f"""
apiVersion: v1
kind: Namespace
metadata:
  name: {namespace}
---
apiVersion: v1
kind: Pod
metadata:
  name: client
  namespace: {namespace}
  labels:{labels}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 1
  containers:
    - name: client
      image: {BUSYBOX}
      imagePullPolicy: Never
      command: [sleep, "3600"]
"""


def connect(kind: Kind, namespace: str, target: Target) -> tuple[bool, str]:
    """One bounded TCP connection from the client pod of `namespace` to `target`."""
    proc = kind.e2e.kubectl(
        "exec", "-n", namespace, "client", "--",
        "timeout", "8", "nc", "-w", "3", target.ip, str(target.port), "-e", "true",
        check=False,
        timeout=30,
    )  # fmt: skip
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def assert_blocked(kind: Kind, namespace: str, targets: list[Target]) -> None:
    results = {t.what: connect(kind, namespace, t) for t in targets}
    connected = [what for what, (ok, _) in results.items() if ok]
    assert not connected, f"{namespace}/client connected to {connected}: {results}"
    # Dropped, not refused by a closed port.
    assert all("timed out" in out for _, out in results.values()), results


def assert_connects(kind: Kind, namespace: str, targets: list[Target], timeout: float = 30) -> None:
    for t in targets:
        last: list[str] = []

        def ok(t: Target = t, last: list[str] = last) -> bool:
            good, out = connect(kind, namespace, t)
            last[:] = [out]
            return good

        try:
            wait_for(ok, timeout, f"{namespace}/client to connect to {t}", interval=1)
        except pytest.fail.Exception:
            pytest.fail(f"{namespace}/client cannot connect to {t}: {last}")


def _running(kind: Kind, selector: str) -> list[dict[str, Any]]:
    pods = kind.e2e.get("pods", "-n", DRIVER_NS, "-l", selector)["items"]
    return [
        p
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]


def _daemon(kind: Kind) -> dict[str, Any] | None:
    proc = kind.e2e.kubectl("get", "daemonset", "-n", DAEMON_NS, DAEMON, "-o", "json", check=False)
    return dict(json.loads(proc.stdout)) if proc.returncode == 0 else None


def _steering(kind: Kind, node: str) -> str:
    """How the node sends packets to the daemon's queue: the daemon's own nftables table
    or, on a kernel without nftables' queue expression (this one), the iptables chain of
    hack/kind/network-policies.sh."""
    table = kind.node_exec(node, "nft", "list", "table", "inet", TABLE)
    if table.returncode == 0:
        return table.stdout
    chain = kind.node_exec(node, "iptables", "-t", "mangle", "-S", CHAIN)
    return chain.stdout if chain.returncode == 0 else ""


def _queue_bound(kind: Kind, node: str) -> bool:
    """A process (the daemon) listens on NFQUEUE QUEUE in the node's network namespace."""
    lines = kind.node_exec(node, "cat", "/proc/net/netfilter/nfnetlink_queue").stdout
    return any(line.split()[:1] == [str(QUEUE)] for line in lines.splitlines())


def _drops(kind: Kind) -> float:
    """The daemon's drop verdicts so far, summed over the workers (its /metrics)."""
    total = 0.0
    for node in kind.workers():
        out = kind.node_exec(
            node, "curl", "-sS", "--max-time", "5", f"http://127.0.0.1:{DAEMON_METRICS}/metrics"
        ).stdout
        for line in out.splitlines():
            if line.startswith("kube_network_policies_packet_count{") and 'verdict="drop"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def clients(kind: Kind) -> Iterator[Clients]:
    assert _daemon(kind) is not None, (
        f"no DaemonSet {DAEMON_NS}/{DAEMON}: hack/kind/create-cluster.sh installs it "
        "(hack/kind/network-policies.sh); without it no NetworkPolicy is enforced"
    )
    node = kind.workers()[0]
    for ns in (SCRAPER_NS, OUTSIDE_NS):
        kind.e2e.kubectl("apply", "-f", "-", input=_client_pod(ns, node))
    try:
        for ns in (SCRAPER_NS, OUTSIDE_NS):
            kind.e2e.wait_pods_ready(ns, "app.kubernetes.io/name=prometheus", 1, timeout=120)
        plugins = sorted(
            (
                Target(f"plugin on {p['spec']['nodeName']}", p["status"]["podIP"], METRICS_PORT)
                for p in _running(kind, PLUGIN)
            ),
            key=lambda t: t.what,
        )
        assert len(plugins) == len(kind.workers()), plugins
        webhook_pods = _running(kind, WEBHOOK)
        assert webhook_pods, "no running webhook pod (webhook.enabled=true in install.sh)"
        svc = kind.e2e.get("service", "-n", DRIVER_NS, f"{RELEASE}-webhook")["spec"]
        webhook = [
            Target(f"webhook pod on {p['spec']['nodeName']}", p["status"]["podIP"], WEBHOOK_PORT)
            for p in webhook_pods
        ] + [Target("webhook Service", svc["clusterIP"], svc["ports"][0]["port"])]
        yield Clients(node=node, plugins=plugins, webhook=webhook)
    finally:
        kind.e2e.kubectl(
            "delete", "namespace", SCRAPER_NS, OUTSIDE_NS, "--ignore-not-found", "--wait=false",
            check=False,
        )  # fmt: skip


def test_network_policy_daemon_runs_on_every_node(kind: Kind, clients: Clients) -> None:
    """First: the implementation runs on every node, listens on its queue, and the node
    steers pod traffic to that queue (with no rule that drops: every verdict is the
    daemon's); and the chart rendered both policies with the peers install.sh gave them."""
    ds = _daemon(kind)
    assert ds is not None
    status = ds["status"]
    nodes = [n["metadata"]["name"] for n in kind.e2e.get("nodes")["items"]]
    assert status.get("numberReady") == status.get("desiredNumberScheduled") == len(nodes), status
    for node in nodes:
        assert _queue_bound(kind, node), f"{node}: nothing listens on NFQUEUE {QUEUE}"
        rules = _steering(kind, node)
        assert re.search(rf"queue .*to {QUEUE}|-j NFQUEUE --queue-num {QUEUE}\b", rules), (
            f"{node}: no steering to queue {QUEUE}:\n{rules}"
        )
        assert not re.search(r"\b(DROP|REJECT|drop|reject)\b", rules), f"{node}:\n{rules}"

    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in kind.e2e.get("networkpolicies", "-n", DRIVER_NS)["items"]
    }
    metrics = policies[f"{RELEASE}-kubeletplugin"]
    assert metrics["policyTypes"] == ["Ingress"], metrics
    assert metrics["ingress"] == [
        {
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": SCRAPER_NS}
                    },
                    "podSelector": {"matchLabels": CLIENT_LABEL},
                }
            ],
            "ports": [{"port": METRICS_PORT, "protocol": "TCP"}],
        }
    ], metrics
    control_plane = kind.e2e.get("nodes", "-l", "node-role.kubernetes.io/control-plane")["items"]
    api_ips = [
        a["address"]
        for n in control_plane
        for a in n["status"]["addresses"]
        if a["type"] == "InternalIP"
    ]
    if kind.engine == "podman":
        # Podman masquerades node-to-remote-pod traffic to the network's gateway (see
        # hack/kind/install.sh): the API server's calls come from there.
        name = control_plane[0]["metadata"]["name"]
        network = kind.env["KIND_NETWORK"]
        fmt = f'{{{{(index .NetworkSettings.Networks "{network}").Gateway}}}}'
        gateway = subprocess.run(
            ["podman", "inspect", name, "--format", fmt],
            env=kind.env, capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()  # fmt: skip
        api_ips.append(gateway)
    webhook = policies[f"{RELEASE}-webhook"]
    assert webhook["ingress"] == [
        {
            "from": [{"ipBlock": {"cidr": f"{ip}/32"}} for ip in api_ips],
            "ports": [{"port": WEBHOOK_PORT, "protocol": "TCP"}],
        }
    ], webhook


def test_outside_pod_reaches_neither_metrics_nor_webhook(kind: Kind, clients: Clients) -> None:
    targets = clients.plugins + clients.webhook
    before = _drops(kind)
    assert_blocked(kind, OUTSIDE_NS, targets)
    # The daemon's own verdicts: at least one dropped SYN per target.
    after = _drops(kind)
    assert after >= before + len(targets), (before, after)


def test_admitted_pod_scrapes_metrics_but_not_the_webhook(kind: Kind, clients: Clients) -> None:
    assert_connects(kind, SCRAPER_NS, clients.plugins)
    for t in clients.plugins:
        out = kind.e2e.kubectl(
            "exec", "-n", SCRAPER_NS, "client", "--",
            "timeout", "10", "wget", "-q", "-O", "-", f"http://{t.ip}:{t.port}/metrics",
            timeout=30,
        ).stdout  # fmt: skip
        assert "gpu_dra_build_info" in out, f"{t}: {out[:500]}"
    # The metrics policy's peers are not the webhook's.
    assert_blocked(kind, SCRAPER_NS, clients.webhook)


def _probe_counts(kind: Kind, node: str, pod: str) -> dict[tuple[str, str], float]:
    """The kubelet's prober_probe_total for one pod: {(probe_type, result): count}."""
    raw = kind.e2e.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics/probes").stdout
    counts: dict[tuple[str, str], float] = {}
    for line in raw.splitlines():
        if not line.startswith("prober_probe_total{") or f'pod="{pod}"' not in line:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        key = (labels["probe_type"], labels["result"])
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_kubelet_probes_still_pass(kind: Kind, clients: Clients) -> None:
    """No node address is admitted to the metrics port, nor a worker's to the webhook
    port: the kubelet's probes pass as the node's root user, whose packets are never
    sent to the daemon (NetworkPolicy's "the pod's own node is always admitted"). Shown
    by the kubelet's own probe counters moving on with no failure, the pods Ready with
    no restart, and the probes' path answering from inside each node."""
    pods = _running(kind, PLUGIN) + _running(kind, WEBHOOK)
    before = {
        p["metadata"]["name"]: _probe_counts(kind, p["spec"]["nodeName"], p["metadata"]["name"])
        for p in pods
    }
    time.sleep(12)  # more than the plugin's liveness period (10 s); readiness: 5 s
    for p in pods:
        name, node = p["metadata"]["name"], p["spec"]["nodeName"]
        was, now = before[name], _probe_counts(kind, node, name)
        for (ptype, result), n in now.items():
            if result != "successful":
                assert n == was.get((ptype, result), 0.0), (name, ptype, result, was, now)
        for ptype in ("Readiness", "Liveness"):
            key = (ptype, "successful")
            assert now.get(key, 0.0) > was.get(key, 0.0), (name, ptype, was, now)
        ready = [c for c in p["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", (name, ready)
        scheme, port = ("https", WEBHOOK_PORT) if "webhook" in name else ("http", METRICS_PORT)
        probe = kind.node_exec(
            node, "curl", "-sS", "-k", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}",
            f"{scheme}://{p['status']['podIP']}:{port}/readyz",
        )  # fmt: skip
        assert probe.stdout == "200", (name, probe.stdout, probe.stderr)
    later = {p["metadata"]["name"]: p for p in _running(kind, PLUGIN) + _running(kind, WEBHOOK)}
    for p in pods:
        name = p["metadata"]["name"]
        assert name in later, f"{name} is gone"
        restarts = [c["restartCount"] for c in later[name]["status"]["containerStatuses"]]
        assert restarts == [c["restartCount"] for c in p["status"]["containerStatuses"]], name


def _claim(interval: str) -> str:
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: netpol-webhook-check, namespace: default}}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {{deviceClassName: {DRIVER}}}
    config:
    - requests: [gpu]
      opaque:
        driver: {DRIVER}
        parameters:
          apiVersion: gpu.resource.example.com/v1alpha1
          kind: GpuConfig
          sharing: {{strategy: TimeSlicing, timeSlicingConfig: {{interval: {interval}}}}}
"""


def test_api_server_still_reaches_the_webhook(kind: Kind, clients: Clients) -> None:
    """The webhook port admits the control-plane node's address: the API server's calls
    get through, so a bad GpuConfig is refused with the webhook's own message (not
    `failed calling webhook`: with failurePolicy Fail an unreachable webhook refuses
    every such claim), and a good one is admitted (server-side dry runs)."""
    bad = kind.e2e.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=_claim("Sometimes"), check=False, timeout=60
    )
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0, out
    assert re.search(r"denied the request: .*unknown time-slice interval: 'Sometimes'", out), out
    assert "failed calling webhook" not in out, out
    good = kind.e2e.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=_claim("Long"), check=False, timeout=60
    )
    assert good.returncode == 0, good.stdout + good.stderr


def test_control_without_the_daemon_the_outsider_connects(kind: Kind, clients: Clients) -> None:
    """The daemon's verdicts are what block the outsider: with the daemon deleted (the
    nodes' steering to its queue left in place, which passes packets nobody listens
    for) the same pod connects to every target; with the daemon back, it is blocked."""
    targets = clients.plugins + clients.webhook
    nodes = [n["metadata"]["name"] for n in kind.e2e.get("nodes")["items"]]
    try:
        kind.e2e.kubectl("delete", "daemonset", "-n", DAEMON_NS, DAEMON, "--wait=true", timeout=120)
        wait_for(
            lambda: not any(_queue_bound(kind, n) for n in nodes),
            60,
            f"no process on NFQUEUE {QUEUE} once {DAEMON} is deleted",
            interval=1,
        )
        assert all(_steering(kind, n) for n in nodes)
        assert_connects(kind, OUTSIDE_NS, targets, timeout=20)
    finally:
        restored = kind.script("network-policies.sh", "install", timeout=600)
    assert restored.returncode == 0, _tail(restored.stdout + restored.stderr)
    assert_blocked(kind, OUTSIDE_NS, targets)
