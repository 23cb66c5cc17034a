"""The schedulers of the scheduler-scale benchmark and their /metrics.

The cluster's own kube-scheduler runs as shipped: its API client is limited to 50
requests/s (burst 100), and it writes four times per pod with one claim (the API
server's request counts of a run: a pod-status patch, the claim's finalizer, the
claim's allocation status, the binding), so past the burst it binds at most
12.5 pods/s whatever the devices. To see the scheduling work itself, a second
kube-scheduler from the same binary, feature gates and credentials runs beside it with
that limit lifted (1000/s) under a scheduler name of its own; a pod picks one by
`spec.schedulerName`.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.cluster import BenchError, LocalCluster, wait_for
from driver.kube.api import KubeApi
from tests.conftest import free_ports

DEFAULT_SCHEDULER = "default-scheduler"
UNTHROTTLED_SCHEDULER = "gpu-dra-scale-unthrottled"
UNTHROTTLED_QPS = 1000
# Flags of the cluster's scheduler the second one does not share (ports, files) or
# that its --config replaces.
_OWN_FLAGS = ("--kubeconfig=", "--secure-port=", "--cert-dir=", "--leader-elect=")


@dataclass(frozen=True)
class SchedulerVariant:
    name: str  # spec.schedulerName
    label: str  # in the results
    qps: int


VARIANTS = (
    SchedulerVariant(DEFAULT_SCHEDULER, "default", 50),
    SchedulerVariant(UNTHROTTLED_SCHEDULER, "unthrottled", UNTHROTTLED_QPS),
)


class SchedulerMetrics:
    """A kube-scheduler's /metrics: its secure port, the admin's credentials."""

    def __init__(self, admin_kubeconfig: Path, port: int, cert_dir: Path, path: Path) -> None:
        doc = yaml.safe_load(admin_kubeconfig.read_text())
        for entry in doc["clusters"]:
            cluster = entry["cluster"]
            cluster["server"] = f"https://127.0.0.1:{port}"
            cluster.pop("certificate-authority-data", None)
            # The scheduler serves a certificate it signed itself, in its --cert-dir.
            cluster["certificate-authority"] = str(cert_dir / "kube-scheduler.crt")
        path.write_text(yaml.safe_dump(doc))
        self._api = KubeApi.from_kubeconfig(str(path))

    def text(self) -> str:
        return self._api.get_text("/metrics")

    def totals(self) -> dict[str, float]:
        return parse_totals(self.text())


def cluster_scheduler_metrics(cluster: LocalCluster, run_dir: Path) -> SchedulerMetrics:
    return SchedulerMetrics(
        cluster.kubeconfig,
        int(cluster.env["GPU_DRA_SCHEDULER_PORT"]),
        run_dir / "kube-scheduler",
        run_dir / "scheduler-metrics.kubeconfig",
    )


class UnthrottledScheduler:
    """A second kube-scheduler beside the cluster's, its client limit lifted."""

    def __init__(self, cluster: LocalCluster, run_dir: Path) -> None:
        pid = (run_dir / "pids" / "kube-scheduler.pid").read_text().strip()
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        binary, flags = args[0], [a for a in args[1:] if a and not a.startswith(_OWN_FLAGS)]
        kubeconfig = next(a for a in args if a.startswith("--kubeconfig=")).split("=", 1)[1]
        work = run_dir / "unthrottled-scheduler"
        work.mkdir()
        config = work / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {
                        "kubeconfig": kubeconfig,
                        "qps": UNTHROTTLED_QPS,
                        "burst": UNTHROTTLED_QPS,
                    },
                    "leaderElection": {"leaderElect": False},
                    "profiles": [{"schedulerName": UNTHROTTLED_SCHEDULER}],
                }
            )
        )
        (port,) = free_ports(1)
        self.log = work / "kube-scheduler.log"
        with self.log.open("w") as log:
            self._process = subprocess.Popen(
                [
                    binary,
                    *flags,
                    f"--config={config}",
                    f"--secure-port={port}",
                    f"--cert-dir={work}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_for(
            lambda: (work / "kube-scheduler.crt").is_file() or self._exited(),
            60,
            "the unthrottled kube-scheduler's serving certificate",
        )
        self._exited()
        self.metrics = SchedulerMetrics(cluster.kubeconfig, port, work, work / "metrics.kubeconfig")
        wait_for(self.metrics.text, 60, "the unthrottled kube-scheduler's /metrics")

    def _exited(self) -> bool:
        if self._process.poll() is not None:
            tail = self.log.read_text()[-2000:]
            raise BenchError(
                f"the unthrottled kube-scheduler exited ({self._process.returncode}):\n{tail}"
            )
        return False

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(15)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


# (name in the results, histogram, label that picks its series): summed over the rest.
HISTOGRAMS = (
    # A pod's whole Filter phase: every node's filter plugins in one scheduling cycle.
    ("filter", "scheduler_framework_extension_point_duration_seconds", 'extension_point="Filter"'),
    # The DRA allocator on one node (the scheduler samples plugin timings).
    (
        "dra_filter_node",
        "scheduler_plugin_execution_duration_seconds",
        'extension_point="Filter",plugin="DynamicResources"',
    ),
    # Scheduling cycle and binding of a pod that got a node.
    ("attempt", "scheduler_scheduling_attempt_duration_seconds", 'result="scheduled"'),
)


def parse_totals(text: str) -> dict[str, float]:
    """`<name>_count` and `<name>_seconds` of each histogram of HISTOGRAMS."""
    totals = {f"{name}_{part}": 0.0 for name, _, _ in HISTOGRAMS for part in ("count", "seconds")}
    for line in text.splitlines():
        for name, metric, label in HISTOGRAMS:
            if not line.startswith(metric) or label not in line:
                continue
            series, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
            if series == f"{metric}_count":
                totals[f"{name}_count"] += value
            elif series == f"{metric}_sum":
                totals[f"{name}_seconds"] += value
    return totals
