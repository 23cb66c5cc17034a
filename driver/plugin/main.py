"""gpu-kubelet-plugin: discovery, ResourceSlices, the kubelet's gRPC services, health."""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from driver.cdi.driver_edits import DriverRoot
from driver.cdi.hook import HOOK_NAME, cdi_hook_path, install_cdi_hook
from driver.devices.gpu_view import gpu_views
from driver.devices.model import PoolError, build_pool
from driver.devices.slices import build_slice_specs
from driver.errors import parse_permanent_errors
from driver.fileio import UnsafeFileError, remove_durably, sweep_temp_files
from driver.health.monitor import HealthMonitor
from driver.health.mps_escapes import MpsEscapes, claim_pods_from
from driver.health.prepare_health import KubeDeviceHealth, NoDeviceHealth
from driver.health.recovery_taints import RecoveryActions, RecoveryAwareHealth, RecoveryPoller
from driver.health.store import HealthStore
from driver.health.unmonitored import UnmonitoredGpus
from driver.health.xid import XidPolicy
from driver.kube.api import KubeApi
from driver.kube.claims import ApiClaimReader, ClaimEvents, ClaimFailureReporter
from driver.kube.kube_events import NodeEvents
from driver.kube.publisher import SlicePublisher
from driver.nvml.library import NvmlUnavailableError
from driver.nvml.selection import select_backend
from driver.observability import metrics
from driver.observability.http import HttpServer
from driver.observability.logs import setup_logging
from driver.observability.status_socket import (
    ServingStatusSocket,
)
from driver.plugin.dra import add_dra_services
from driver.plugin.health import add_health_services
from driver.plugin.memory_limit_requests import ForgetRequestsOnUnprepare, serve_memory_limits
from driver.plugin.mps_setup import mps_daemons, mps_others, watch_mps_daemons
from driver.plugin.node_status import PluginStatus, export_gpus, export_journal
from driver.plugin.options.flags import PluginOptions, package_version, parse_options
from driver.plugin.options.node_overrides import NodeLabelRead
from driver.plugin.plugin_status import (
    Healthz,
    bind_http,
    bind_status_socket,
    describe_recovery,
    export_checkpoint_state,
    health_report,
)
from driver.plugin.readiness import Readiness
from driver.plugin.serving_instance import InstanceLock, Succession
from driver.plugin.toolkit_config import check_toolkit_config, report_toolkit_check
from driver.plugin.transport.registration import DRA_SERVICES, HEALTH_SERVICES, RegistrationServicer
from driver.plugin.transport.serving import BuiltServer, SocketServer, SocketWatcher, new_server
from driver.plugin.transport.sockets import socket_paths
from driver.proto.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from driver.state.prepare import DeviceState
from driver.state.recovery.startup_recovery import compact_journal

log = logging.getLogger("gpu-kubelet-plugin")

SHUTDOWN_GRACE_SECONDS = 5.0
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
        o.data_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        o.cdi_root.mkdir(parents=True, exist_ok=True, mode=0o755)
        instance = InstanceLock(o.data_dir)
        succession = Succession(o.data_dir)
        policy = XidPolicy.from_flags(
            additional_ignored=o.additional_xids_to_ignore, fatal=o.fatal_xids
        )
        backend = select_backend(
            mock=o.mock,
            fleet_path=o.mock_fleet,
            node_name=o.node_name,
            mock_driver_root=o.plugin_mock_driver_root,
            driver_root=o.nvidia_driver_root,
        )
        monitor_thread = HealthMonitor.THREAD_NAME
        metrics.NVML_CALLS.count_from(
            lambda: backend.nvml_calls.get(monitor_thread, 0), caller="health-monitor"
        )
        metrics.NVML_CALLS.count_from(
            lambda: sum(n for t, n in backend.nvml_calls.items() if t != monitor_thread),
            caller="other",
        )
        # The mock with a (fake) driver installation writes complete CDI specs too.
        complete_cdi = not o.mock or o.nvidia_driver_root != Path("/")
        driver_root = real_driver_root(o) if complete_cdi else None
        if o.mock and driver_root is not None:
            log.warning(
                "MOCK GPUs with the driver installation at %s: CDI specs carry device "
                "nodes, its files and hooks as on a real node",
                driver_root.host_path,
            )
        toolkit = None if driver_root is None else check_toolkit_config(o.nvidia_driver_root)
        if toolkit is not None:
            report_toolkit_check(toolkit)
        metrics.API_WRITES.count_from(lambda: api.writes)
        store = HealthStore(o.data_dir / "health.json")
        state = DeviceState(
            driver_name=o.driver_name,
            node_name=o.node_name,
            devices={},  # set below, once discovery ran
            cdi_root=o.cdi_root,
            data_dir=o.data_dir,
            claims=ApiClaimReader(api),
            health=NoDeviceHealth(),
            reporter=ClaimFailureReporter(
                api, driver=o.driver_name, node_name=o.node_name, device_status=o.device_status
            ),
            real_devices=complete_cdi,
            mig=backend.mig(),
            caps_root=backend.kernel_root,
            proc_devices=backend.kernel_root / "proc" / "devices",
            driver_root=driver_root,
            permanent_errors=parse_permanent_errors(o.permanent_errors),
            timeslice=backend.timeslice(o.nvidia_driver_root),
            mps_daemons=mps_daemons(o, backend, api),
            mps_others=mps_others(o, backend, api),
            compute_modes=backend.compute_modes(),
        )
        export_checkpoint_state(state)
        journal = export_journal(state)
        if driver_root is not None:
            install_image_hook(o, state)
        # Before discovery: recovery destroys half-created MIG devices and recreates
        # the ones a reboot destroyed, so discovery sees the node as it will be served.
        recovered = state.recover()
        log.info("recovered local state: %s", describe_recovery(recovered))

        # The listing and the journal snapshot of one moment, under the node lock (an
        # old instance may still be serving during a rolling update).
        inventory, owned_mig = state.discover_with_owned(backend.discover)
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

        recovery = RecoveryActions(devices, driver=o.driver_name)
        unmonitored = UnmonitoredGpus(devices, driver=o.driver_name)

        # Processes outside MPS on GPUs with MPS shares, looked for after each check of
        # the MPS daemons (docs/mps.md, "Escapes"); their taint with --mps-escape-taint.
        escapes = MpsEscapes(
            backend.gpu_processes,
            ClaimEvents(api, driver=o.driver_name, node_name=o.node_name),
            devices,
            driver=o.driver_name,
            claim_pods=claim_pods_from(ApiClaimReader(api)),
            taint=o.mps_escape_taint,
            on_taints_changed=lambda: publisher.trigger(),
            proc_root=backend.kernel_root / "proc",
        )

        def desired_slices() -> list[dict[str, object]]:
            taints = store.device_taints(devices, driver=o.driver_name, effect=o.xid_taint_effect)
            taints = escapes.add_taints(unmonitored.add_taints(recovery.add_taints(taints)))
            return build_slice_specs(
                pool, driver=o.driver_name, node_name=o.node_name, taints=taints
            )

        publisher = SlicePublisher(
            api,
            driver=o.driver_name,
            node_name=o.node_name,
            desired=desired_slices,
            may_write=succession.serving,
        )
        state.devices = devices
        limit_requests = (
            serve_memory_limits(backend, o.data_dir, inventory, state, running)
            if o.gpu_memory_limits
            else None
        )
        state.health = RecoveryAwareHealth(
            KubeDeviceHealth(store, publisher, devices, effect=o.xid_taint_effect),
            recovery,
            publisher,
        )
        monitor = HealthMonitor(
            backend,
            store,
            policy,
            publisher,
            devices,
            node_name=o.node_name,
            # What the backend adds: on the mock, its `gpu-dra mock ...` and wait.
            control_actions=backend.control_actions(devices),
            wait_timeout_ms=backend.event_wait_ms,
            gpu_names={gpu.uuid: gpu.name for gpu in gpus},
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
        running.callback(publisher.stop)  # slices stay: a restart must not lose them
        running.callback(monitor.stop)
        # Runs after the service socket stopped (callbacks run in reverse): the journal's
        # log folded into a snapshot every release reads (docs/state.md, "The log").
        running.callback(compact_journal, state, drain_seconds=SHUTDOWN_DRAIN_SECONDS)
        # before compaction
        mps_watch = watch_mps_daemons(o, state, api, running, recovered, after_check=escapes)

        paths = socket_paths(o.driver_name, o.registrar_dir, o.data_dir, o.pod_uid or None)

        def build_service() -> BuiltServer:
            # Each open health stream holds a worker thread for its lifetime.
            server = new_server(max_workers=16)
            preparer = (
                state
                if limit_requests is None
                else ForgetRequestsOnUnprepare(state, limit_requests)
            )
            add_dra_services(server, preparer, serving_instead=succession.newer)
            health = add_health_services(
                server, store, devices, pool_name=o.node_name, recovery=recovery
            )
            return BuiltServer(server, before_stop=health.stop)

        registration = RegistrationServicer(
            o.driver_name,
            str(paths.service),
            DRA_SERVICES + HEALTH_SERVICES,
            on_registered=succession.registered,
        )

        def build_registration() -> BuiltServer:
            server = new_server(max_workers=2)
            registration_grpc.add_RegistrationServicer_to_server(registration, server)
            return BuiltServer(server)

        status = PluginStatus(
            version=self.version,
            node=o.node_name,
            driver=o.driver_name,
            taint_effect=o.xid_taint_effect,
            gpus=gpus,
            devices=devices,
            registration=registration,
            publisher=publisher,
            store=store,
            recovery=recovery,
            unmonitored=unmonitored,
            state=state,
            journal=journal,
            toolkit=toolkit,
            mps=mps_watch,
            succession=succession,
        )
        status_socket = ServingStatusSocket(
            lambda: bind_status_socket(
                o.data_dir, status.document, healthz, control=monitor.control.respond
            )
        )
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
        service_socket = SocketServer("service", paths.service, build_service)
        registration_socket = SocketServer("registration", paths.registration, build_registration)
        # The service first: the kubelet dials it as soon as the registration appears.
        # Stopped the other way round: removing the registration socket deregisters.
        service_socket.start()
        running.callback(service_socket.stop, SHUTDOWN_GRACE_SECONDS)
        registration_socket.start()
        running.callback(registration_socket.stop, 0)
        log.info("serving %s; registration socket %s", paths.service, paths.registration)
        metrics.KUBELET_REGISTERED.set_function(lambda: float(registration.registered.is_set()))
        metrics.SERVING.set_function(lambda: float(succession.serving()))
        watcher = SocketWatcher(
            service_socket, registration_socket, on_reregister=registration.registered.clear
        )

        publisher.start()
        monitor.start()
        watcher.start()
        running.callback(watcher.stop)

        def healthy() -> tuple[bool, str]:
            return health_report(
                registered=registration.registered.is_set(),
                last_synced=publisher.stats.last_synced,
                checkpoint_problem=state.checkpoint_problem,
                health_store_problem=store.problem,
                publish_problem=publisher.stats.failing,
            )

        healthz.serve(healthy)
        if http is not None:
            http.serve_readiness(Readiness(registration, paths))
            http.start()

        def remove_common_spec() -> None:
            remove_durably(state.cdi.common_spec_path)

        def leave() -> bool:
            # The last instance leaves: an uninstall must not leave CDI files behind.
            # (Claim specs go with their unprepare; ResourceSlices are removed by the
            # kubelet once no instance is registered.)
            return instance.release(on_last=remove_common_spec)

        return leave


def real_driver_root(o: PluginOptions) -> DriverRoot:
    """The driver root as CDI specs name it, with the host path of nvidia-cdi-hook."""
    hook = cdi_hook_path(o.nvidia_cdi_hook_path, o.data_dir)
    if not o.nvidia_cdi_hook_path and shutil.which(HOOK_NAME) is None:
        raise ValueError(f"{HOOK_NAME} is not on PATH; set --nvidia-cdi-hook-path")
    return DriverRoot(o.nvidia_driver_root, o.nvidia_driver_root_host, hook)


def install_image_hook(o: PluginOptions, state: DeviceState) -> None:
    """Copy the image's nvidia-cdi-hook to the host under the node lock, which a rolling
    update's other instance also takes: a crash's temp files can be swept then."""
    if o.nvidia_cdi_hook_path:
        return
    source = Path(shutil.which(HOOK_NAME) or HOOK_NAME)
    with state.lock.hold():
        sweep_temp_files(o.data_dir, HOOK_NAME)
        install_cdi_hook(source, o.data_dir)


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
