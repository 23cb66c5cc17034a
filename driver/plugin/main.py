"""gpu-kubelet-plugin: its start in steps (local state, recovery and discovery,
ResourceSlices and health, the kubelet's sockets, which instance serves) and its stop."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import FrameType

from driver.devices.device_types import PublishedDevice
from driver.devices.gpu_view import GpuView, gpu_views
from driver.devices.model import PoolDevices, PoolError, build_pool
from driver.devices.slices import build_slice_specs
from driver.fileio import UnsafeFileError, remove_durably
from driver.health.monitor import HealthMonitor
from driver.health.mps_escapes import MpsEscapes, claim_pods_from
from driver.health.prepare_health import KubeDeviceHealth
from driver.health.recovery_taints import RecoveryActions, RecoveryAwareHealth, RecoveryPoller
from driver.health.unmonitored import UnmonitoredGpus
from driver.health.xid import XidPolicy
from driver.kube.api import KubeApi
from driver.kube.claims import ApiClaimReader, ClaimEvents
from driver.kube.kube_events import NodeEvents
from driver.kube.publisher import SlicePublisher
from driver.nvml.discovered import Inventory
from driver.nvml.library import NvmlUnavailableError
from driver.observability import metrics
from driver.observability.http import HttpServer
from driver.observability.logs import setup_logging
from driver.observability.status_socket import ServingStatusSocket
from driver.plugin.kubelet_sockets import KubeletSockets
from driver.plugin.local_node import LocalNode, open_local_node
from driver.plugin.memory_limit_requests import MemoryLimitRequests, serve_memory_limits
from driver.plugin.mps_setup import watch_mps_daemons
from driver.plugin.node_status import PluginStatus, export_gpus
from driver.plugin.options.flags import PluginOptions, package_version, parse_options
from driver.plugin.options.node_overrides import NodeLabelRead
from driver.plugin.plugin_status import (
    Healthz,
    bind_http,
    bind_status_socket,
    describe_recovery,
    health_report,
)
from driver.plugin.readiness import Readiness
from driver.plugin.serving_instance import Succession
from driver.plugin.transport.registration import RegistrationServicer
from driver.state.mps_watch import MpsWatch
from driver.state.recovery.startup_recovery import RecoveryReport, compact_journal

log = logging.getLogger("gpu-kubelet-plugin")

# How long a clean stop waits for prepares and unprepares still running (a MIG create
# takes seconds) before it compacts the journal; within the chart's 30 s grace period.
SHUTDOWN_DRAIN_SECONDS = 15.0
# How often the main thread wakes while it waits to stop. A signal that the kernel
# hands to another thread (grpc's, the publisher's) runs its Python handler only once
# the main thread runs Python again: an endless wait would never see SIGTERM.
SIGNAL_CHECK_SECONDS = 0.5
# Errors that mean "the flags or the node's configuration are wrong" (option values,
# fleet files, no NVML, a pool that cannot be built): reported in one line.
CONFIG_ERRORS = (ValueError, NvmlUnavailableError, PoolError)  # a bad fleet file is a ValueError


@dataclass(frozen=True)
class Discovery:
    """The node's GPUs after recovery, and the devices published for them."""

    recovered: RecoveryReport
    inventory: Inventory
    pool: PoolDevices
    devices: dict[str, PublishedDevice]
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True)
class Health:
    """What publishes the slices with their taints and watches the devices."""

    publisher: SlicePublisher
    recovery: RecoveryActions
    unmonitored: UnmonitoredGpus
    monitor: HealthMonitor
    limit_requests: MemoryLimitRequests | None
    mps_watch: MpsWatch | None


class Plugin:
    def __init__(self, options: PluginOptions, version: str) -> None:
        self.options = options
        self.version = version
        self.stopping = threading.Event()

    def run(self) -> int:
        o = self.options
        # Before anything touches the host: the API server's settings and the HTTP port
        # (a busy port must not leave sockets in the kubelet's directories).
        api = KubeApi.from_kubeconfig(o.kubeconfig)
        healthz = Healthz()
        http = bind_http(o.http_port, healthz)
        with contextlib.ExitStack() as running:
            if http is not None:
                running.callback(http.shutdown)
            leave = self._serve(api, healthz, http, running)
            while not self.stopping.wait(SIGNAL_CHECK_SECONDS):
                pass
            log.info("shutting down")
        leave()
        return 0

    def _serve(
        self,
        api: KubeApi,
        healthz: Healthz,
        http: HttpServer | None,
        running: contextlib.ExitStack,
    ) -> Callable[[], object]:
        """Start everything; `running` stops it, in the reverse order. Returns what
        releases this instance's hold on the node once everything stopped."""
        o = self.options
        # Sent now, awaited when the pool is built: the API round trip overlaps the
        # local work below (NVML, recovery, discovery) instead of following it.
        node_label = NodeLabelRead(api, o.node_name, o.driver_name)
        node = open_local_node(self.options, api)
        found = self._recover_and_discover(node, node_label)
        health = self._watch_health(api, node, found, running)
        sockets = KubeletSockets(
            o,
            node.state,
            limit_requests=health.limit_requests,
            store=node.store,
            devices=found.devices,
            recovery=health.recovery,
            succession=node.succession,
        )
        status_socket = self._status_socket(healthz, node, found, health, sockets.registration)
        self._take_turn(node.succession, health.publisher, status_socket, running)
        watcher = sockets.start(running)
        health.publisher.start()
        health.monitor.start()
        watcher.start()
        running.callback(watcher.stop)

        def healthy() -> tuple[bool, str]:
            return health_report(
                registered=sockets.registration.registered.is_set(),
                last_synced=health.publisher.stats.last_synced,
                checkpoint_problem=node.state.checkpoint_problem,
                health_store_problem=node.store.problem,
                publish_problem=health.publisher.stats.failing,
            )

        healthz.serve(healthy)
        if http is not None:
            http.serve_readiness(Readiness(sockets.registration, sockets.paths))
            http.start()

        def remove_common_spec() -> None:
            remove_durably(node.state.cdi.common_spec_path)

        def leave() -> bool:
            # The last instance leaves: an uninstall must not leave CDI files behind.
            # (Claim specs go with their unprepare; ResourceSlices are removed by the
            # kubelet once no instance is registered.)
            return node.instance.release(on_last=remove_common_spec)

        return leave

    def _recover_and_discover(self, node: LocalNode, node_label: NodeLabelRead) -> Discovery:
        o = self.options
        state = node.state
        # Before discovery: recovery destroys half-created MIG devices and recreates
        # the ones a reboot destroyed, so discovery sees the node as it will be served.
        recovered = state.recover()
        log.info("recovered local state: %s", describe_recovery(recovered))

        # The listing and the journal snapshot of one moment, under the node lock (an
        # old instance may still be serving during a rolling update).
        inventory, owned_mig = state.discover_with_owned(node.backend.discover)
        # `mpsIsolation` where the node runs MPS daemons (docs/mps.md): "strict" on a
        # whole GPU its one daemon holds in EXCLUSIVE_PROCESS, else "cooperative".
        options = replace(o.pool_options(), mps=state.mps.site is not None)
        node_profiles = node_label.profiles()
        if node_profiles is not None:
            log.info("MIG profiles from the Node's label: %s", ", ".join(node_profiles))
            options = replace(options, mig_profiles=node_profiles)
        pool = build_pool(inventory, options, owned_mig=owned_mig)
        for note in pool.notes:
            log.warning("%s", note)
        devices = {device.name: device for device in pool.devices}
        metrics.PUBLISHED_DEVICES.set(len(devices))
        gpus = gpu_views(inventory, pool.mig_modes)
        export_gpus(gpus, self.version)
        log.info(
            "discovered %d GPU(s) via %s: publishing %d devices (MIG: %s)",
            len(inventory.gpus),
            inventory.backend,
            len(devices),
            ", ".join(f"{uuid} {mode}" for uuid, mode in pool.mig_modes.items()) or "none",
        )
        return Discovery(recovered, inventory, pool, devices, gpus)

    def _watch_health(
        self, api: KubeApi, node: LocalNode, found: Discovery, running: contextlib.ExitStack
    ) -> Health:
        """The slices' publisher and the health monitor; from here the device state
        serves the discovered devices and reports their health through them."""
        o = self.options
        state, devices = node.state, found.devices
        recovery = RecoveryActions(devices, driver=o.driver_name)
        unmonitored = UnmonitoredGpus(devices, driver=o.driver_name)

        # Processes outside MPS on GPUs with MPS shares, looked for after each check of
        # the MPS daemons (docs/mps.md, "Escapes"); their taint with --mps-escape-taint.
        escapes = MpsEscapes(
            node.backend.gpu_processes,
            ClaimEvents(api, driver=o.driver_name, node_name=o.node_name),
            devices,
            driver=o.driver_name,
            claim_pods=claim_pods_from(ApiClaimReader(api)),
            taint=o.mps_escape_taint,
            on_taints_changed=lambda: publisher.trigger(),
            proc_root=node.backend.kernel_root / "proc",
        )

        def desired_slices() -> list[dict[str, object]]:
            taints = node.store.device_taints(
                devices, driver=o.driver_name, effect=o.xid_taint_effect
            )
            taints = escapes.add_taints(unmonitored.add_taints(recovery.add_taints(taints)))
            return build_slice_specs(
                found.pool, driver=o.driver_name, node_name=o.node_name, taints=taints
            )

        publisher = SlicePublisher(
            api,
            driver=o.driver_name,
            node_name=o.node_name,
            desired=desired_slices,
            may_write=node.succession.serving,
        )
        state.devices = devices
        limit_requests = (
            serve_memory_limits(node.backend, o.data_dir, found.inventory, state, running)
            if o.gpu_memory_limits
            else None
        )
        state.health = RecoveryAwareHealth(
            KubeDeviceHealth(node.store, publisher, devices, effect=o.xid_taint_effect),
            recovery,
            publisher,
        )
        monitor = self._health_monitor(api, node, found, publisher, recovery, unmonitored)
        running.callback(publisher.stop)  # slices stay: a restart must not lose them
        running.callback(monitor.stop)
        # Runs after the service socket stopped (callbacks run in reverse): the journal's
        # log folded into a snapshot every release reads (docs/state.md, "The log").
        running.callback(compact_journal, state, drain_seconds=SHUTDOWN_DRAIN_SECONDS)
        # before compaction
        mps_watch = watch_mps_daemons(o, state, api, running, found.recovered, after_check=escapes)
        return Health(publisher, recovery, unmonitored, monitor, limit_requests, mps_watch)

    def _health_monitor(
        self,
        api: KubeApi,
        node: LocalNode,
        found: Discovery,
        publisher: SlicePublisher,
        recovery: RecoveryActions,
        unmonitored: UnmonitoredGpus,
    ) -> HealthMonitor:
        o = self.options
        backend = node.backend
        monitor = HealthMonitor(
            backend,
            node.store,
            XidPolicy.from_flags(
                additional_ignored=o.additional_xids_to_ignore, fatal=o.fatal_xids
            ),
            publisher,
            found.devices,
            node_name=o.node_name,
            # What the backend adds: on the mock, its `gpu-dra mock ...` and wait.
            control_actions=backend.control_actions(found.devices),
            wait_timeout_ms=backend.event_wait_ms,
            gpu_names={gpu.uuid: gpu.name for gpu in found.gpus},
            node_events=NodeEvents(api, driver=o.driver_name, node_name=o.node_name),
            driver=o.driver_name,
            taint_effect=o.xid_taint_effect,
            recovery=recovery,
            unmonitored=unmonitored,
        )
        interval = o.recovery_action_poll_interval  # 0: off
        if interval:
            monitor.add_poller(
                RecoveryPoller(
                    backend.recovery_actions,
                    recovery,
                    publisher,
                    interval=interval,
                    on_change=monitor.recovery_changed,
                )
            )
        return monitor

    def _status_socket(
        self,
        healthz: Healthz,
        node: LocalNode,
        found: Discovery,
        health: Health,
        registration: RegistrationServicer,
    ) -> ServingStatusSocket:
        """The status socket (`gpu-dra status`, control requests), bound while this
        instance serves the node."""
        o = self.options
        status = PluginStatus(
            version=self.version,
            node=o.node_name,
            driver=o.driver_name,
            taint_effect=o.xid_taint_effect,
            gpus=found.gpus,
            devices=found.devices,
            registration=registration,
            publisher=health.publisher,
            store=node.store,
            recovery=health.recovery,
            unmonitored=health.unmonitored,
            state=node.state,
            journal=node.journal,
            toolkit=node.toolkit,
            mps=health.mps_watch,
            succession=node.succession,
        )
        return ServingStatusSocket(
            lambda: bind_status_socket(
                o.data_dir, status.document, healthz, control=health.monitor.control.respond
            )
        )

    def _take_turn(
        self,
        succession: Succession,
        publisher: SlicePublisher,
        status_socket: ServingStatusSocket,
        running: contextlib.ExitStack,
    ) -> None:
        """Publish and bind the status socket while this instance serves the node."""
        succession.on_change(lambda serving: serving and publisher.trigger())
        succession.on_change(status_socket.serving)
        running.callback(status_socket.shutdown)
        # Run after the sockets stopped (callbacks run in reverse): once the kubelet
        # forgot this instance, the one it outranked serves again at once.
        running.callback(succession.stop)
        # Serving from here if no other instance does; else from the kubelet's
        # registration of this one (docs/rolling-updates.md).
        if not succession.start():
            log.info("another plugin instance serves the node: waiting for the registration")
        succession.watch()


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_options(argv)
    setup_logging(options.log_format, options.verbosity)
    version = package_version()
    log.info("gpu-kubelet-plugin %s starting on node %s", version, options.node_name)
    plugin = Plugin(options, version)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        plugin.stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        return plugin.run()
    except UnsafeFileError as err:
        # A symlink or FIFO where the plugin keeps a file of its own (a claim lock in
        # the data directory): it did not make it, and never follows or removes it.
        print(
            f"gpu-kubelet-plugin: {err.filename} {err.strerror}; the plugin did not create "
            "it: find out how it got there, remove it and restart the plugin",
            file=sys.stderr,
        )
        return 1
    except CONFIG_ERRORS as err:
        # A configuration problem: one clear line, no traceback.
        print(f"gpu-kubelet-plugin: {err}", file=sys.stderr)
        return 1
    except Exception:
        log.exception("gpu-kubelet-plugin failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
