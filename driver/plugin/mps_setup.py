"""Which MPS daemons the plugin runs (--mps-daemons, docs/mps.md): none, processes of
the node, or a Deployment per device (the plugin under Kubernetes); and the check of
them while it runs (driver/state/mps_watch.py)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from driver.kube.api import KubeApi
from driver.kube.claims import ClaimEvents
from driver.kube.mps_daemons import KubeDaemons
from driver.kube.mps_manifest import DaemonPodSettings
from driver.nvml.backend import NvmlBackend
from driver.plugin.flags import PluginOptions
from driver.state.context import StepContext
from driver.state.mps.claim_daemons import MpsDaemons, NodeDaemons
from driver.state.mps_watch import MpsWatch
from driver.state.recovery.startup_recovery import RecoveryReport

log = logging.getLogger(__name__)


def mps_daemons(o: PluginOptions, backend: NvmlBackend, api: KubeApi) -> MpsDaemons | None:
    """None where MPS is off or the driver root has no nvidia-cuda-mps-control (an MPS
    claim is then refused, naming the reason)."""
    if o.mps_daemons == "off":
        return None
    control = backend.mps(o.nvidia_driver_root)
    if control is None:
        log.warning(
            "--mps-daemons=%s, but there is no nvidia-cuda-mps-control under the driver "
            "root %s: MPS claims are refused",
            o.mps_daemons,
            o.nvidia_driver_root,
        )
        return None
    if o.mps_daemons == "node":
        return NodeDaemons(control)
    # The mock's driver root is a host path (under the plugin's data directory, which
    # the chart mounts at the same path); a real one is --nvidia-driver-root-host.
    host_root = control.driver_root if o.mock else Path(o.nvidia_driver_root_host)
    settings = DaemonPodSettings(
        namespace=o.pod_namespace,
        node_name=o.node_name,
        driver_name=o.driver_name,
        image=o.mps_daemon_image,
        driver_root_host=host_root,
        driver_root=control.driver_root,
    )
    log.info(
        "MPS daemons run as Deployments in namespace %s, image %s",
        o.pod_namespace,
        o.mps_daemon_image,
    )
    return KubeDaemons(api, settings)


def watch_mps_daemons(
    o: PluginOptions,
    state: StepContext,
    api: KubeApi,
    running: contextlib.ExitStack,
    recovered: RecoveryReport,
) -> MpsWatch | None:
    """Report the daemons the start found gone (`recovered`) and start the periodic
    check of the prepared claims' daemons, stopped by `running`; None where this node
    has no MPS."""
    if state.mps.site is None:
        return None
    watch = MpsWatch(state, ClaimEvents(api, driver=o.driver_name, node_name=o.node_name))
    watch.report_start(recovered.mps_losses)
    watch.start()
    running.callback(watch.stop)
    return watch
