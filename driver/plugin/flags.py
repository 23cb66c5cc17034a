"""Command-line flags of gpu-kubelet-plugin. Every flag can also come from its env var."""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from driver.plugin.host_inputs import check_driver_name, check_path

PACKAGE = "gpu-dra-driver"
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")
# Path flags (argparse dest -> flag), by whether the plugin writes under them.
WRITTEN_DIR_FLAGS = {
    "cdi_root": "--cdi-root",
    "registrar_dir": "--kubelet-registrar-directory-path",
    "plugins_dir": "--kubelet-plugins-directory-path",
    "mock_driver_root": "--mock-driver-root",
}
READ_PATH_FLAGS = {
    "nvidia_driver_root": "--nvidia-driver-root",
    "nvidia_driver_root_host": "--nvidia-driver-root-host",
    "nvidia_cdi_hook_path": "--nvidia-cdi-hook-path",
}
OPTIONAL_STRING_PATHS = frozenset({"nvidia_cdi_hook_path"})  # "" means none


def package_version() -> str:
    """The installed gpu-dra-driver version (package metadata), or "unknown"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "unknown"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")


MIG_STRATEGIES = ("auto", "dynamic", "static")


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _env_bool(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def non_negative_int(flag: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: {value!r} is not an integer") from None
        if number < 0:
            raise argparse.ArgumentTypeError(f"{flag}: must be >= 0, got {number}")
        return number

    return parse


@dataclass(frozen=True)
class PluginOptions:
    node_name: str
    driver_name: str
    cdi_root: Path
    registrar_dir: Path
    plugins_dir: Path
    pod_uid: str
    nvml_backend: str
    mock_fleet: str | None
    gpu_partitions: int
    mig_strategy: str
    allow_multiple_allocations: bool
    mock_driver_root: Path | None
    nvidia_driver_root: Path
    nvidia_driver_root_host: Path
    nvidia_cdi_hook_path: str
    xid_taint_effect: str
    additional_xids_to_ignore: str
    fatal_xids: str
    permanent_errors: str
    device_status: bool
    http_port: int
    log_format: str
    verbosity: int
    kubeconfig: str | None

    @property
    def data_dir(self) -> Path:
        return self.plugins_dir / self.driver_name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu-kubelet-plugin",
        description="DRA kubelet plugin for GPUs and their partitions.",
    )
    add_version_flag(p)
    p.add_argument("--node-name", default=_env("NODE_NAME"), help="this node (env NODE_NAME)")
    p.add_argument(
        "--driver-name", default=_env("DRIVER_NAME", "gpu.example.com"), help="DRA driver name"
    )
    p.add_argument("--cdi-root", type=Path, default=Path(_env("CDI_ROOT", "/var/run/cdi") or ""))
    p.add_argument(
        "--kubelet-registrar-directory-path",
        dest="registrar_dir",
        type=Path,
        default=Path(
            _env("KUBELET_REGISTRAR_DIRECTORY_PATH", "/var/lib/kubelet/plugins_registry") or ""
        ),
    )
    p.add_argument(
        "--kubelet-plugins-directory-path",
        dest="plugins_dir",
        type=Path,
        default=Path(_env("KUBELET_PLUGINS_DIRECTORY_PATH", "/var/lib/kubelet/plugins") or ""),
    )
    p.add_argument(
        "--pod-uid", default=_env("POD_UID", ""), help="enables rolling-update socket names"
    )
    p.add_argument(
        "--nvml-backend",
        choices=("nvml", "mock"),
        default=_env("NVML_BACKEND", "nvml"),
        help="real NVML, or mock GPUs (never chosen implicitly)",
    )
    p.add_argument(
        "--mock-fleet", default=_env("MOCK_FLEET"), help="fleet YAML for the mock backend"
    )
    p.add_argument(
        "--gpu-partitions",
        type=non_negative_int("--gpu-partitions"),
        default=_env("GPU_PARTITIONS", "0"),  # a string: argparse applies `type` to it
        help="N equal partitions per GPU (reference-compatible); 0 = MIG partitions",
    )
    p.add_argument(
        "--mig-strategy",
        choices=MIG_STRATEGIES,
        default=_env("MIG_STRATEGY", "auto"),
        help="GPUs in MIG mode: auto (static where MIG devices exist, else dynamic), "
        "dynamic (created at prepare) or static (existing MIG devices only)",
    )
    p.add_argument(
        "--gpu-allow-multiple-allocations",
        action="store_true",
        default=_env_bool("GPU_ALLOW_MULTIPLE_ALLOCATIONS"),
        help="publish whole GPUs and --gpu-partitions partitions with "
        "allowMultipleAllocations and memory/compute request policies (consumable "
        "capacity; shares are time-sliced, limits advisory: docs/sharing.md)",
    )
    p.add_argument(
        "--mock-driver-root",
        type=Path,
        default=_env("MOCK_DRIVER_ROOT"),
        help="mock backend: where its MIG state and capability files live "
        "(default: <plugin data dir>/mock-driver-root)",
    )
    p.add_argument(
        "--nvidia-driver-root",
        type=Path,
        default=_env("NVIDIA_DRIVER_ROOT", "/"),
        help="real NVML: where this process sees the NVIDIA driver's files",
    )
    p.add_argument(
        "--nvidia-driver-root-host",
        type=Path,
        default=_env("NVIDIA_DRIVER_ROOT_HOST"),
        help="the driver root on the host, which CDI specs name (default: --nvidia-driver-root)",
    )
    p.add_argument(
        "--nvidia-cdi-hook-path",
        default=_env("NVIDIA_CDI_HOOK_PATH", "") or "",
        help="nvidia-cdi-hook on the host, named in CDI specs; none: the image's copy, "
        "installed into the plugin's data directory at start",
    )
    p.add_argument(
        "--xid-taint-effect", choices=TAINT_EFFECTS, default=_env("XID_TAINT_EFFECT", "NoSchedule")
    )
    p.add_argument(
        "--additional-xids-to-ignore", default=_env("ADDITIONAL_XIDS_TO_IGNORE", "") or ""
    )
    p.add_argument("--fatal-xids", default=_env("FATAL_XIDS", "") or "")
    p.add_argument(
        "--permanent-errors",
        default=_env("PERMANENT_ERRORS", "invalid-config,device-failed"),
        help="error classes reported as permanent (KEP-5322)",
    )
    p.add_argument(
        "--device-status",
        action="store_true",
        default=_env_bool("DEVICE_STATUS"),
        help="write conditions into the claim's device status",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=_env("HTTP_PORT", "8080"),
        help="/metrics and /healthz; -1 disables",
    )
    p.add_argument(
        "--log-format", choices=("text", "json"), default=_env("LOG_FORMAT", "text") or "text"
    )
    p.add_argument("-v", "--v", dest="verbosity", type=int, default=_env("V", "0"))
    p.add_argument(
        "--kubeconfig",
        default=_env("KUBECONFIG"),
        help="kubeconfig file; none: the in-cluster config",
    )
    document_env_and_defaults(p)
    return p


def env_name(action: argparse.Action) -> str:
    """The environment variable of a flag: its long name, upper case (--mig-strategy:
    MIG_STRATEGY, --v: V)."""
    return flag_env(action.option_strings[-1])


def flag_env(flag: str) -> str:
    return flag.lstrip("-").upper().replace("-", "_")


def document_env_and_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(env X, default: Y)" to every flag's help."""
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        default = "none" if action.default in (None, "") else "%(default)s"
        suffix = f"(env {env_name(action)}, default: {default})"
        action.help = f"{action.help} {suffix}" if action.help else suffix


def check_host_inputs(args: argparse.Namespace) -> None:
    """ValueError naming the flag (and its env var) whose value would put the plugin's
    files somewhere it must not write (`driver.plugin.host_inputs`)."""
    written = functools.partial(check_path, written=True)
    read = functools.partial(check_path, written=False)
    checks: list[tuple[str, str, Callable[[str], object]]] = [
        ("driver_name", "--driver-name", check_driver_name),
        *((dest, flag, written) for dest, flag in WRITTEN_DIR_FLAGS.items()),
        *((dest, flag, read) for dest, flag in READ_PATH_FLAGS.items()),
    ]
    for dest, flag, check in checks:
        value = getattr(args, dest)
        if value is None or (dest in OPTIONAL_STRING_PATHS and value == ""):
            continue  # not given: its default is derived from a checked flag
        try:
            check(str(value))
        except ValueError as err:
            raise ValueError(f"{flag} (env {flag_env(flag)}): {err}") from None


def parse_options(argv: Sequence[str] | None = None) -> PluginOptions:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.node_name:
        parser.error("--node-name (or NODE_NAME) is required")
    # argparse checks choices of values given on the command line only; a default
    # taken from the environment must pass the same check.
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            allowed = ", ".join(map(str, action.choices))
            parser.error(
                f"{action.option_strings[-1]}: invalid value {value!r} "
                f"(from the environment; choose from {allowed})"
            )
    try:
        check_host_inputs(args)
    except ValueError as err:  # before anything touches the host: one line, exit 1
        parser.exit(1, f"{parser.prog}: {err}\n")
    return PluginOptions(
        node_name=args.node_name,
        driver_name=args.driver_name,
        cdi_root=args.cdi_root,
        registrar_dir=args.registrar_dir,
        plugins_dir=args.plugins_dir,
        pod_uid=args.pod_uid,
        nvml_backend=args.nvml_backend,
        mock_fleet=args.mock_fleet,
        gpu_partitions=args.gpu_partitions,
        mig_strategy=args.mig_strategy,
        allow_multiple_allocations=args.gpu_allow_multiple_allocations,
        mock_driver_root=args.mock_driver_root,
        nvidia_driver_root=args.nvidia_driver_root,
        nvidia_driver_root_host=args.nvidia_driver_root_host or args.nvidia_driver_root,
        nvidia_cdi_hook_path=args.nvidia_cdi_hook_path,
        xid_taint_effect=args.xid_taint_effect,
        additional_xids_to_ignore=args.additional_xids_to_ignore,
        fatal_xids=args.fatal_xids,
        permanent_errors=args.permanent_errors,
        device_status=args.device_status,
        http_port=args.http_port,
        log_format=args.log_format,
        verbosity=args.verbosity,
        kubeconfig=args.kubeconfig,
    )
