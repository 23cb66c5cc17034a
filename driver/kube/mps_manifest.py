"""The Deployment that runs one prepared device's MPS control daemon under Kubernetes
(docs/mps.md, "The daemon's Deployment"; driver/kube/mps_daemons.py creates it).

One replica pinned to the plugin's node by `nodeName`, privileged and in the host's PID
namespace (the MPS server checks its clients by pid), running `gpu-dra-mps-daemon`
(driver/plugin/mps_daemon.py) from the plugin's own image. The device's directories are
host paths shared with the plugin and the clients: `pipe/`, `log/`, and `shm/` at
/dev/shm here and in every client container. The plugin makes them, with their modes,
and mounts the tmpfs on `shm/` before it creates the Deployment (driver/state/mps/
daemons.py, driver/state/mps/shm.py): the pod's bind mount of the host path holds that
tmpfs. The MPS server that the daemon starts for a non-root client runs as the client's
uid and reaches `pipe/` and `log/` through their mounts here, whose parents in the
container are the runtime's (0755).

The pod is QoS Guaranteed and `system-node-critical` (never evicted for its usage, never
preempted): the pod going ends every client's GPU work. The chart's admission policy
pins these values.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from driver.config.mps_limits import MIB
from driver.nvml.mps import DaemonDirs
from driver.state.journal.mps_record import MpsRecord

CONTAINER: Final = "mps-control-daemon"
COMMAND: Final = "gpu-dra-mps-daemon"
READY_FILE: Final = "/run/gpu-dra-mps/startup-complete"
COMPONENT: Final = "mps-daemon"
NAME_PREFIX: Final = "gpu-dra-mps-"
PRIORITY_CLASS: Final = "system-node-critical"
# The memory limit is the pod's end (reached, the MPS server is killed with every
# client's work), so it errs high: gpu-dra-mps-daemon takes 28 MiB on the mock, the MPS
# server what a CUDA process takes after its context (commonly 100-300 MiB; not measured
# here). The daemon and the server are idle but when a client connects: 200m caps a
# runaway at a fifth of a core and only slows connects. Requests equal limits: every
# daemon reserves this on its node.
RESOURCES: Final = {"cpu": "200m", "memory": "512Mi"}


@dataclass(frozen=True)
class DaemonPodSettings:
    """What every daemon Deployment of this plugin shares (from the chart's env)."""

    namespace: str
    node_name: str
    driver_name: str
    image: str
    # The driver root on the host, and where the daemon's container sees it (the
    # plugin's --nvidia-driver-root; the mock's driver root is a host path of its own).
    driver_root_host: Path
    driver_root: Path
    image_pull_policy: str = "IfNotPresent"

    @property
    def label(self) -> str:
        """The label every daemon Deployment and its pods carry (value: its name);
        the chart's admission policy requires it."""
        return f"{self.driver_name}/mps-daemon"


def deployment_name(node_name: str, directory: str) -> str:
    """The daemon's Deployment name, from the node and the device's directory (its
    CDI device name): found again from the journal's intent alone."""
    digest = hashlib.sha256(f"{node_name}/{directory}".encode()).hexdigest()
    return NAME_PREFIX + digest[:20]


def _host_dir(name: str, path: Path, mount: str, *, read_only: bool = False) -> tuple[Any, Any]:
    volume = {"name": name, "hostPath": {"path": str(path), "type": "DirectoryOrCreate"}}
    volume_mount: dict[str, Any] = {"name": name, "mountPath": mount}
    if read_only:
        volume_mount.update(readOnly=True, mountPropagation="HostToContainer")
    return volume, volume_mount


def daemon_args(settings: DaemonPodSettings, record: MpsRecord, dirs: DaemonDirs) -> list[str]:
    args = [
        COMMAND,
        f"--driver-root={settings.driver_root}",
        f"--pipe-directory={dirs.pipe}",
        f"--log-directory={dirs.log}",
        f"--gpu={record.gpu_uuid}",
        f"--ready-file={READY_FILE}",
        *(["--multi-user"] if record.shared else []),
    ]
    if record.active_thread_percentage is not None:
        args.append(f"--active-thread-percentage={record.active_thread_percentage}")
    if record.pinned_memory_bytes is not None:
        args.append(f"--pinned-memory-mib={record.pinned_memory_bytes // MIB}")
    return args


def daemon_deployment(
    settings: DaemonPodSettings, record: MpsRecord, dirs: DaemonDirs
) -> dict[str, Any]:
    name = deployment_name(settings.node_name, record.directory)
    labels = {settings.label: name, "app.kubernetes.io/component": COMPONENT}
    if dirs.shm is None:
        raise ValueError("a daemon in a pod of its own needs a shm directory")
    mounts = [
        _host_dir("pipe", dirs.pipe, str(dirs.pipe)),
        _host_dir("log", dirs.log, str(dirs.log)),
        _host_dir("shm", dirs.shm, "/dev/shm"),
        _host_dir(
            "driver-root", settings.driver_root_host, str(settings.driver_root), read_only=True
        ),
        (
            {"name": "run", "emptyDir": {"medium": "Memory"}},
            {"name": "run", "mountPath": "/run/gpu-dra-mps"},
        ),
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": labels,
            "annotations": {
                f"{settings.driver_name}/node": settings.node_name,
                f"{settings.driver_name}/mps-device": record.directory,
                f"{settings.driver_name}/gpu": record.gpu_uuid,
            },
        },
        "spec": {
            "replicas": 1,
            # Never two daemons on one pipe directory, not even during a rollout.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {settings.label: name}},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "nodeName": settings.node_name,
                    "hostPID": True,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    # The driver's own GPU taints (NoExecute included) must not evict
                    # the daemon of a claim that still runs.
                    "tolerations": [{"operator": "Exists"}],
                    "terminationGracePeriodSeconds": 30,
                    "priorityClassName": PRIORITY_CLASS,
                    "containers": [
                        {
                            "name": CONTAINER,
                            "image": settings.image,
                            "imagePullPolicy": settings.image_pull_policy,
                            "command": daemon_args(settings, record, dirs),
                            "resources": {"requests": dict(RESOURCES), "limits": dict(RESOURCES)},
                            # The image's user is not root; the daemon must be.
                            "securityContext": {
                                "privileged": True,
                                "runAsUser": 0,
                                "runAsGroup": 0,
                            },
                            "startupProbe": {
                                "exec": {"command": ["test", "-f", READY_FILE]},
                                "periodSeconds": 1,
                                "failureThreshold": 300,
                            },
                            "volumeMounts": [m for _, m in mounts],
                        }
                    ],
                    "volumes": [v for v, _ in mounts],
                },
            },
        },
    }
