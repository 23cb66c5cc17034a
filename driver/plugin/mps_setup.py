"""Which MPS daemons the plugin runs (--mps-daemons, docs/mps.md): none, processes of
the node, or a Deployment per device (the plugin under Kubernetes); the kinds it can
still stop whatever the setting (`mps_others`: a claim prepared under another setting
is unprepared all the same); and the check of them while it runs
(driver/state/mps_watch.py).

Every kind carries the tmpfs of `--mps-shm-size` that the plugin mounts on a daemon's
shm directory (driver/state/mps/shm.py): the kind that runs mounts it before its
daemon starts, whichever kind stops a daemon unmounts it. Under Kubernetes the plugin
is in a pod, so its mount must propagate to the node."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from driver.kube.api import KubeApi
from driver.kube.claims import ClaimEvents
from driver.kube.kube_events import NodeEvent, NodeEvents
from driver.kube.mps_daemons import KubeDaemons
from driver.kube.mps_manifest import DaemonPodSettings
from driver.nvml.backend import NvmlBackend
from driver.nvml.mps import MpsControl
from driver.plugin.options.flags import PluginOptions
from driver.state.context import StepContext
from driver.state.mps.daemons import MpsDaemons, NodeDaemons
from driver.state.mps.shm import ShmBound
from driver.state.mps_watch import AfterCheck, MpsWatch
from driver.state.recovery.startup_recovery import RecoveryReport

log = logging.getLogger(__name__)


def _kube_daemons(o: PluginOptions, control: MpsControl, api: KubeApi) -> KubeDaemons:
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
    return KubeDaemons(api, settings, shm=ShmBound(o.mps_shm_size, needs_propagation=True))


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
        return NodeDaemons(control, shm=ShmBound(o.mps_shm_size))
    log.info(
        "MPS daemons run as Deployments in namespace %s, image %s",
        o.pod_namespace,
        o.mps_daemon_image,
    )
    return _kube_daemons(o, control, api)


def mps_others(o: PluginOptions, backend: NvmlBackend, api: KubeApi) -> tuple[MpsDaemons, ...]:
    """Every kind of daemon this plugin can stop, whatever --mps-daemons says (the
    journal may name daemons started under another setting): node processes (by their
    binary's `quit`, or by signals where it is gone) and, in a pod (--pod-namespace),
    Deployments. `StepContext` leaves out the kind that runs now; these only stop."""
    control = backend.mps(o.nvidia_driver_root) or MpsControl(o.nvidia_driver_root)
    node = NodeDaemons(control, shm=ShmBound(o.mps_shm_size))
    return (node, _kube_daemons(o, control, api)) if o.pod_namespace else (node,)


def watch_mps_daemons(
    o: PluginOptions,
    state: StepContext,
    api: KubeApi,
    running: contextlib.ExitStack,
    recovered: RecoveryReport,
    after_check: AfterCheck,
) -> MpsWatch | None:
    """Report the daemons the start found gone (`recovered`) and start the periodic
    check of the prepared claims' daemons and the sweep of what no claim owns, stopped
    by `running`, each check followed by `after_check` (the look for processes outside
    MPS); None where this node has no MPS (then swept once, here)."""
    node_events = NodeEvents(api, driver=o.driver_name, node_name=o.node_name)
    node_events.start()
    running.callback(node_events.stop)
    watch = MpsWatch(
        state,
        ClaimEvents(api, driver=o.driver_name, node_name=o.node_name),
        node_events=lambda reason, message: node_events.post(NodeEvent(reason, message)),
        after_check=after_check,
    )
    if state.mps.site is None:
        watch.sweep()
        return None
    watch.report_start(recovered.mps_losses)
    watch.start()
    running.callback(watch.stop)
    return watch
