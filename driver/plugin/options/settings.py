"""The kubelet plugin's settings: each one a flag and its environment variable, parsed
and checked here for gpu-kubelet-plugin and for `gpu-dra inventory`.

Both read the same names the same way, so `kubectl exec <plugin pod> -- gpu-dra
inventory` sees the pod's DRIVER_NAME, NVML_BACKEND, MOCK_FLEET, GPU_PARTITIONS,
MIG_STRATEGY, GPU_ALLOW_MULTIPLE_ALLOCATIONS, ... and shows what the plugin publishes.

A value comes from the command line, else from the environment variable, else the
default; values from either source are checked alike. An empty variable counts as
unset, except for `--permanent-errors`, where it means "no class". A bad value is a
`SettingError` naming the flag and its variable, which the binaries print as one line
(exit 1) before anything touches the host. A boolean takes true/false (also 1/0,
yes/no, on/off); its flag alone means true.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.devices.device_types import MigStrategy, PoolOptions
from driver.health.xid import TAINT_EFFECTS
from driver.plugin.options import setting_values as v
from driver.plugin.options.host_inputs import check_driver_name
from driver.plugin.options.setting_values import MIG_STRATEGIES

NVML_BACKENDS = ("nvml", "mock")
LOG_FORMATS = ("text", "json")


class SettingError(ValueError):
    """A bad setting value; the message names the flag and its environment variable."""


def flag_env(flag: str) -> str:
    """A flag's environment variable: its long name, upper case (--mig-strategy:
    MIG_STRATEGY, --v: V)."""
    return flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True)
class Setting:
    """One setting. `parse` turns the text into the value or raises ValueError."""

    dest: str
    flag: str
    help: str
    parse: Callable[[str], Any]
    default: str | None = None  # as text, the way the variable would give it
    metavar: str | None = None
    switch: bool = False  # a boolean: the flag alone means true
    short: str | None = None
    empty_is_a_value: bool = False  # an empty variable is the value "", not unset

    @property
    def env(self) -> str:
        return flag_env(self.flag)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.short, self.flag) if self.short else (self.flag,)


# -- the settings ------------------------------------------------------------------

NODE_NAME = Setting("node_name", "--node-name", "this node: pool name, mock UUID seed", str)
DRIVER_NAME = Setting(
    "driver_name",
    "--driver-name",
    "DRA driver name (a DNS subdomain)",
    check_driver_name,
    "gpu.example.com",
)
PLUGINS_DIR = Setting(
    "plugins_dir",
    "--kubelet-plugins-directory-path",
    "the kubelet's plugin directory; the plugin's state is in <dir>/<driver name>",
    v.written_dir,
    "/var/lib/kubelet/plugins",
    metavar="DIR",
)
NVML_BACKEND = Setting(
    "nvml_backend",
    "--nvml-backend",
    "real NVML, or mock GPUs (never chosen implicitly)",
    v.choice(*NVML_BACKENDS),
    "nvml",
    metavar="{" + ",".join(NVML_BACKENDS) + "}",
)
MOCK_FLEET = Setting(
    "mock_fleet",
    "--mock-fleet",
    "mock backend: fleet YAML file or built-in fleet name (docs/mock-fleet.md)",
    v.mock_fleet,
    metavar="FLEET",
)
MOCK_DRIVER_ROOT = Setting(
    "mock_driver_root",
    "--mock-driver-root",
    "mock backend: where its MIG state and capability files live "
    "(none: <plugins dir>/<driver name>/mock-driver-root)",
    v.written_dir,
    metavar="DIR",
)
NVIDIA_DRIVER_ROOT = Setting(
    "nvidia_driver_root",
    "--nvidia-driver-root",
    "real NVML: where this process sees the NVIDIA driver's files",
    v.read_path,
    "/",
    metavar="DIR",
)
GPU_PARTITIONS = Setting(
    "gpu_partitions",
    "--gpu-partitions",
    "N equal, time-shared partitions per GPU (the reference's model); 0: MIG partitions",
    v.integer(0),
    "0",
    metavar="N",
)
MIG_STRATEGY = Setting(
    "mig_strategy",
    "--mig-strategy",
    "GPUs in MIG mode: auto (static where MIG devices exist that the driver did not "
    "create, else dynamic), dynamic (created at prepare) or static (existing MIG devices "
    "only)",
    v.mig_strategy,
    MigStrategy.AUTO.value,
    metavar="{" + ",".join(MIG_STRATEGIES) + "}",
)
MIG_PROFILES = Setting(
    "mig_profiles",
    "--mig-profiles",
    "dynamic MIG: publish the placements of these MIG profiles only, e.g. "
    "1g.10gb,3g.40gb,7g.80gb (the whole GPU stays published); the node label "
    "<driver name>/mig-profiles (e.g. 1g10gb_3g40gb) overrides it per node; empty: every "
    "profile",
    v.mig_profiles,
    "",
    metavar="PROFILES",
)
ALLOW_MULTIPLE_ALLOCATIONS = Setting(
    "allow_multiple_allocations",
    "--gpu-allow-multiple-allocations",
    "publish whole GPUs and --gpu-partitions partitions with allowMultipleAllocations "
    "and memory/compute request policies (consumable capacity; shares are time-sliced, "
    "with --mps-daemons limited through MPS per client process and only for processes "
    "that use MPS, else advisory: docs/sharing.md)",
    v.boolean,
    "false",
    switch=True,
)
XID_TAINT_EFFECT = Setting(
    "xid_taint_effect",
    "--xid-taint-effect",
    "effect of the taint on a failed GPU: NoSchedule, NoExecute (the control plane "
    "evicts its pods) or None (informational: prepare is not refused; Kubernetes >= 1.35)",
    v.taint_effect,
    "NoSchedule",
    metavar="{" + ",".join(TAINT_EFFECTS) + "}",
)
CDI_ROOT = Setting(
    "cdi_root", "--cdi-root", "where CDI specs are written", v.written_dir, "/var/run/cdi"
)
REGISTRAR_DIR = Setting(
    "registrar_dir",
    "--kubelet-registrar-directory-path",
    "the kubelet's plugin registration directory",
    v.written_dir,
    "/var/lib/kubelet/plugins_registry",
    metavar="DIR",
)
POD_UID = Setting(
    "pod_uid", "--pod-uid", "this pod's UID: per-pod socket names for rolling updates", str
)
NVIDIA_DRIVER_ROOT_HOST = Setting(
    "nvidia_driver_root_host",
    "--nvidia-driver-root-host",
    "the driver root on the host, which CDI specs name (none: --nvidia-driver-root)",
    v.read_path,
    metavar="DIR",
)
NVIDIA_CDI_HOOK_PATH = Setting(
    "nvidia_cdi_hook_path",
    "--nvidia-cdi-hook-path",
    "nvidia-cdi-hook on the host, named in CDI specs (none: the image's copy, installed "
    "into the plugin's data directory at start)",
    v.read_path_text,
    metavar="PATH",
)
ADDITIONAL_XIDS_TO_IGNORE = Setting(
    "additional_xids_to_ignore",
    "--additional-xids-to-ignore",
    "comma-separated Xids to ignore besides 13, 31, 43, 45, 68, 109, or 'all'",
    v.xid_list,
    metavar="XIDS",
)
FATAL_XIDS = Setting(
    "fatal_xids",
    "--fatal-xids",
    "comma-separated Xids that are always fatal, beating every ignore list, or 'all'",
    v.xid_list,
    metavar="XIDS",
)
PERMANENT_ERRORS = Setting(
    "permanent_errors",
    "--permanent-errors",
    "error classes reported as permanent (KEP-5322): invalid-config, device-failed",
    v.permanent_errors,
    "invalid-config,device-failed",
    metavar="CLASSES",
    empty_is_a_value=True,
)
DEVICE_STATUS = Setting(
    "device_status",
    "--device-status",
    "write conditions into the claim's device status (Kubernetes >= 1.36)",
    v.boolean,
    "false",
    switch=True,
)
HTTP_PORT = Setting(
    "http_port", "--http-port", "/metrics and /healthz; -1: off", v.http_port, "8080", "PORT"
)
LOG_FORMAT = Setting(
    "log_format",
    "--log-format",
    "log lines as text or JSON (docs/operations.md, log reference)",
    v.choice(*LOG_FORMATS),
    "text",
    metavar="{" + ",".join(LOG_FORMATS) + "}",
)
MPS_DAEMON_PLACES = ("off", "node", "kubernetes")
MPS_DAEMONS = Setting(
    "mps_daemons",
    "--mps-daemons",
    "where the MPS control daemons run (docs/mps.md): off (MPS claims are refused; "
    "shares, partitions and SpacePartitioning advisory), node (processes of this node: "
    "the plugin outside Kubernetes), kubernetes (a Deployment per device in "
    "--pod-namespace)",
    v.choice(*MPS_DAEMON_PLACES),
    "off",
    metavar="{" + ",".join(MPS_DAEMON_PLACES) + "}",
)
MPS_STRICT_PARTITIONS = Setting(
    "mps_strict_partitions",
    "--mps-strict-partitions",
    "with --gpu-partitions and MPS daemons: the partitions of a GPU of Volta or later "
    "share one MPS server held in EXCLUSIVE_PROCESS, published mpsIsolation strict "
    "(docs/mps.md); off: a daemon per claim, cooperative",
    v.boolean,
    "false",
    switch=True,
)
POD_NAMESPACE = Setting(
    "pod_namespace",
    "--pod-namespace",
    "this pod's namespace, where --mps-daemons=kubernetes creates the daemons",
    str,
)
MPS_DAEMON_IMAGE = Setting(
    "mps_daemon_image",
    "--mps-daemon-image",
    "the image of the MPS daemons' pods (--mps-daemons=kubernetes): the plugin's own",
    str,
    metavar="IMAGE",
)
KUBECONFIG = Setting(
    "kubeconfig", "--kubeconfig", "kubeconfig file (none: the in-cluster config)", str
)

# What decides the devices a node publishes: read by the plugin and by `gpu-dra
# inventory`.
NODE_SETTINGS = (
    NODE_NAME,
    DRIVER_NAME,
    PLUGINS_DIR,
    NVML_BACKEND,
    MOCK_FLEET,
    MOCK_DRIVER_ROOT,
    NVIDIA_DRIVER_ROOT,
    GPU_PARTITIONS,
    MIG_STRATEGY,
    MIG_PROFILES,
    ALLOW_MULTIPLE_ALLOCATIONS,
    XID_TAINT_EFFECT,
    MPS_DAEMONS,
    MPS_STRICT_PARTITIONS,
)


@dataclass(frozen=True)
class NodeSettings:
    """What decides the devices this node publishes (`NODE_SETTINGS`)."""

    node_name: str
    driver_name: str
    plugins_dir: Path
    nvml_backend: str
    mock_fleet: str | None
    mock_driver_root: Path | None
    nvidia_driver_root: Path
    gpu_partitions: int
    mig_strategy: MigStrategy
    mig_profiles: tuple[str, ...]
    allow_multiple_allocations: bool
    xid_taint_effect: str
    mps_daemons: str
    mps_strict_partitions: bool

    @property
    def data_dir(self) -> Path:
        return self.plugins_dir / self.driver_name

    @property
    def mock(self) -> bool:
        return self.nvml_backend == "mock"

    @property
    def plugin_mock_driver_root(self) -> Path:
        """Where the plugin keeps the mock's MIG state and capability files."""
        return self.mock_driver_root or self.data_dir / "mock-driver-root"

    def pool_options(self) -> PoolOptions:
        return PoolOptions(
            driver_name=self.driver_name,
            gpu_partitions=self.gpu_partitions,
            mig_strategy=self.mig_strategy,
            allow_multiple_allocations=self.allow_multiple_allocations,
            mig_profiles=self.mig_profiles,
            # The plugin also checks for nvidia-cuda-mps-control in the driver root.
            mps=self.mps_daemons != "off",
            mps_strict_partitions=self.mps_strict_partitions,
        )


def add_settings(
    parser: argparse.ArgumentParser,
    settings: Iterable[Setting],
    *,
    default_text: Mapping[str, str] | None = None,
) -> None:
    """A flag for each setting, its help ending in "(env X, default: Y)". Values stay
    text for `read_settings`; `default_text` describes defaults set elsewhere."""
    for setting in settings:
        shown = (default_text or {}).get(setting.dest, setting.default) or "none"
        suffix = f"(env {setting.env}, default: {shown})"
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if setting.switch else {}
        parser.add_argument(
            *setting.names,
            dest=setting.dest,
            default=None,
            metavar=setting.metavar or ("BOOL" if setting.switch else None),
            help=f"{setting.help} {suffix}",
            **extra,
        )


def setting_text(setting: Setting, args: argparse.Namespace) -> str | None:
    """The setting's text: the command line's, else the variable's, else the default."""
    given: str | None = getattr(args, setting.dest, None)
    if given is not None:
        return given
    from_env = os.environ.get(setting.env)
    if from_env or (from_env == "" and setting.empty_is_a_value):
        return from_env
    return setting.default


def read_settings(args: argparse.Namespace, settings: Iterable[Setting]) -> dict[str, Any]:
    """Every setting's value (None where none is given and there is no default).
    Raises SettingError naming the first bad one."""
    values: dict[str, Any] = {}
    for setting in settings:
        text = setting_text(setting, args)
        if text is None:
            values[setting.dest] = None
            continue
        try:
            values[setting.dest] = setting.parse(text)
        except ValueError as err:
            raise SettingError(f"{setting.flag} (env {setting.env}): {err}") from None
    return values


def node_settings(values: Mapping[str, Any]) -> NodeSettings:
    return NodeSettings(**{s.dest: values[s.dest] for s in NODE_SETTINGS})
