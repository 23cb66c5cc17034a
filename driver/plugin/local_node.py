"""The plugin's first step on the node: its place there (the instance lock, the
succession of instances in a rolling update, docs/rolling-updates.md), the NVML
backend, the driver installation (the driver root CDI specs name, the Container
Toolkit's configuration checked, the image's nvidia-cdi-hook copied to the host) and
the device state, opened but not yet recovered."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from driver.cdi.driver_edits import DriverRoot
from driver.cdi.hook import HOOK_NAME, cdi_hook_path, install_cdi_hook
from driver.errors import parse_permanent_errors
from driver.fileio import sweep_temp_files
from driver.health.monitor import HealthMonitor
from driver.health.prepare_health import NoDeviceHealth
from driver.health.store import HealthStore
from driver.kube.api import KubeApi
from driver.kube.claims import ApiClaimReader, ClaimFailureReporter
from driver.nvml.backend import NvmlBackend
from driver.nvml.selection import select_backend
from driver.observability import metrics
from driver.plugin.journal_summary import JournalReader
from driver.plugin.mps_setup import mps_daemons, mps_others
from driver.plugin.node_status import export_journal
from driver.plugin.options.flags import PluginOptions
from driver.plugin.plugin_status import export_checkpoint_state
from driver.plugin.serving_instance import InstanceLock, Succession
from driver.plugin.toolkit_config import ToolkitCheck, check_toolkit_config, report_toolkit_check
from driver.state.prepare import DeviceState

log = logging.getLogger("gpu-kubelet-plugin")


@dataclass(frozen=True)
class LocalNode:
    """This instance's place on the node, and the node's state before discovery."""

    instance: InstanceLock
    succession: Succession
    backend: NvmlBackend
    store: HealthStore
    state: DeviceState
    journal: JournalReader
    toolkit: ToolkitCheck | None


def open_local_node(o: PluginOptions, api: KubeApi) -> LocalNode:
    """Take this instance's place, load NVML, check the driver installation and
    open the device state (not yet recovered)."""
    o.data_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    o.cdi_root.mkdir(parents=True, exist_ok=True, mode=0o755)
    instance = InstanceLock(o.data_dir)
    succession = Succession(o.data_dir)
    backend = _backend(o)
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
        devices={},  # set once discovery ran (main.py, `_watch_health`)
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
    return LocalNode(instance, succession, backend, store, state, journal, toolkit)


def _backend(o: PluginOptions) -> NvmlBackend:
    """The NVML backend, its calls counted by caller."""
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
    return backend


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
