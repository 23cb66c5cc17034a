"""Command-line flags of gpu-kubelet-plugin. Every flag can also come from its env var;
each is parsed and checked by `driver.plugin.options.settings`."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from driver.health.recovery_taints import DEFAULT_POLL_SECONDS
from driver.observability.logs import DAEMON_VERBOSITY, VERBOSITY_HELP
from driver.plugin.options import settings as s
from driver.plugin.options.setting_values import boolean, integer
from driver.plugin.options.settings import (
    NodeSettings,
    Setting,
    SettingError,
    add_settings,
    flag_env,
    read_settings,
)
from driver.state.mps.shm import DEFAULT_SIZE as DEFAULT_MPS_SHM_SIZE
from driver.state.mps.shm import shm_size

VERBOSITY = Setting(
    "verbosity",
    "--v",
    VERBOSITY_HELP,
    integer(0),
    str(DAEMON_VERBOSITY),
    metavar="N",
    short="-v",
)
RECOVERY_ACTION_POLL_INTERVAL = Setting(
    "recovery_action_poll_interval",
    "--recovery-action-poll-interval",
    "seconds between reads of every GPU's NVML recovery action (docs/health.md); 0: off",
    integer(0, 3600),
    str(DEFAULT_POLL_SECONDS),
    metavar="SECONDS",
)
MPS_SHM_SIZE = Setting(
    "mps_shm_size",
    "--mps-shm-size",
    "the size of the tmpfs the plugin mounts as each MPS daemon's and its clients' "
    "/dev/shm (docs/mps.md), a quantity (1Gi, 512Mi); 0: no tmpfs, a plain directory",
    shm_size,
    DEFAULT_MPS_SHM_SIZE,
    metavar="SIZE",
)
MPS_ESCAPE_TAINT = Setting(
    "mps_escape_taint",
    "--mps-escape-taint",
    "taint every device of a GPU with MPS shares <driver>/mps-escape:NoSchedule while a "
    "process runs on it outside MPS (docs/mps.md, Escapes)",
    boolean,
    "false",
    switch=True,
)
GPU_MEMORY_LIMITS = Setting(
    "gpu_memory_limits",
    "--gpu-memory-limits",
    "where the GPU driver has per-cgroup memory limits (R615 and later), hold each "
    "container of a claim with a memory share to that share (a CDI hook at container "
    "creation; the plugin needs the host's PID and cgroup namespaces; docs/mps.md)",
    boolean,
    "false",
    switch=True,
)
# In --help order.
PLUGIN_SETTINGS: tuple[Setting, ...] = (
    s.NODE_NAME,
    s.DRIVER_NAME,
    s.CDI_ROOT,
    s.REGISTRAR_DIR,
    s.PLUGINS_DIR,
    s.POD_UID,
    s.NVML_BACKEND,
    s.MOCK_FLEET,
    s.GPU_PARTITIONS,
    s.MIG_STRATEGY,
    s.MIG_PROFILES,
    s.ALLOW_MULTIPLE_ALLOCATIONS,
    s.MOCK_DRIVER_ROOT,
    s.NVIDIA_DRIVER_ROOT,
    s.NVIDIA_DRIVER_ROOT_HOST,
    s.NVIDIA_CDI_HOOK_PATH,
    s.XID_TAINT_EFFECT,
    s.ADDITIONAL_XIDS_TO_IGNORE,
    s.FATAL_XIDS,
    RECOVERY_ACTION_POLL_INTERVAL,
    s.PERMANENT_ERRORS,
    s.DEVICE_STATUS,
    s.MPS_DAEMONS,
    s.MPS_STRICT_PARTITIONS,
    MPS_ESCAPE_TAINT,
    GPU_MEMORY_LIMITS,
    s.POD_NAMESPACE,
    s.MPS_DAEMON_IMAGE,
    MPS_SHM_SIZE,
    s.HTTP_PORT,
    s.LOG_FORMAT,
    VERBOSITY,
    s.KUBECONFIG,
)


def package_version() -> str:
    """The installed gpu-dra-driver version (package metadata), or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpu-dra-driver")
    except PackageNotFoundError:
        return "unknown"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")


def non_negative_int(flag: str) -> Callable[[str], int]:
    """An argparse `type` (a usage error, exit 2): for the CLI's own flags."""
    parse = integer(0)

    def argument(value: str) -> int:
        try:
            return parse(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{flag}: {err}") from None

    return argument


@dataclass(frozen=True)
class PluginOptions(NodeSettings):
    """Every setting of the plugin (`PLUGIN_SETTINGS`), checked."""

    cdi_root: Path
    registrar_dir: Path
    pod_uid: str
    nvidia_driver_root_host: Path
    nvidia_cdi_hook_path: str
    additional_xids_to_ignore: str
    fatal_xids: str
    recovery_action_poll_interval: int
    permanent_errors: str
    device_status: bool
    pod_namespace: str
    mps_daemon_image: str
    mps_escape_taint: bool
    gpu_memory_limits: bool
    mps_shm_size: int
    http_port: int
    log_format: str
    verbosity: int
    kubeconfig: str | None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-kubelet-plugin",
        description="DRA kubelet plugin for GPUs and their partitions. A bad setting ends "
        "in one line and exit code 1.",
    )
    add_version_flag(parser)
    add_settings(parser, PLUGIN_SETTINGS)
    return parser


def document_env_and_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(env X, default: Y)" to every flag's help (for parsers whose flags do not
    come from `driver.plugin.options.settings`)."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        default = "none" if action.default in (None, "") else "%(default)s"
        suffix = f"(env {flag_env(action.option_strings[-1])}, default: {default})"
        action.help = f"{action.help} {suffix}" if action.help else suffix


def read_options(args: argparse.Namespace) -> PluginOptions:
    """The checked options; SettingError naming the first bad value."""
    values = read_settings(args, PLUGIN_SETTINGS)
    if not values["node_name"]:
        raise SettingError(f"{s.NODE_NAME.flag} (env {s.NODE_NAME.env}) is required")
    values["nvidia_driver_root_host"] = (
        values["nvidia_driver_root_host"] or values["nvidia_driver_root"]
    )
    for name in (
        "pod_uid",
        "nvidia_cdi_hook_path",
        "additional_xids_to_ignore",
        "fatal_xids",
        "pod_namespace",
        "mps_daemon_image",
    ):
        values[name] = values[name] or ""
    if values["mps_daemons"] == "kubernetes":
        for needed in (s.POD_NAMESPACE, s.MPS_DAEMON_IMAGE):
            if not values[needed.dest]:
                raise SettingError(
                    f"{s.MPS_DAEMONS.flag}=kubernetes needs {needed.flag} (env {needed.env})"
                )
    return PluginOptions(**values)


def parse_options(argv: Sequence[str] | None = None) -> PluginOptions:
    """The options of the command line and the environment. A bad value ends the
    process with one line and exit code 1, before anything touches the host."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return read_options(args)
    except SettingError as err:
        parser.exit(1, f"{parser.prog}: {err}\n")
