"""`gpu-dra inventory`: discover GPUs and show what this node would publish.

It reads the plugin's settings, flags and environment variables alike
(`driver.plugin.options.settings`: NODE_NAME, DRIVER_NAME, NVML_BACKEND, MOCK_FLEET,
GPU_PARTITIONS, MIG_STRATEGY, GPU_ALLOW_MULTIPLE_ALLOCATIONS, XID_TAINT_EFFECT,
MPS_DAEMONS: the attribute `mpsIsolation`, ...),
and the plugin's journal (`<state dir>/checkpoint.json`) for the MIG devices it created
for prepared claims, so that in the plugin's pod it shows what the plugin publishes.
Real NVML (pynvml) is used unless NVML_BACKEND=mock; `--mock [FLEET]` is short for
`--nvml-backend=mock [--mock-fleet=FLEET]`: a fleet YAML file, a built-in fleet name
(`default`: 8 x H100-80GB with MIG, `example`: the Go reference's 8 devices), or
nothing for the default fleet. The mock's MIG state is read from MOCK_DRIVER_ROOT, else
`<state dir>/mock-driver-root` where the plugin keeps it; a fleet named by `--mock FLEET`
starts without MIG devices (the plugin's MIG state is of its own fleet) unless
`--mock-driver-root` is given. Output: a table of GPUs
(default; `--partitions` lists partitions too) or the ResourceSlice documents (yaml,
json).

The table's HEALTH column comes from the health store of the plugin on this node
(`<state dir>/health.json`, read only): `--state-dir DIR`, else $GPU_DRA_STATE_DIR,
else the plugin's data dir <KUBELET_PLUGINS_DIRECTORY_PATH>/<driver name> if it
exists. Without one, HEALTH says `unknown`: inventory never claims a GPU is healthy
without reading what the plugin recorded. Taints show the plugin's effect
(`--xid-taint-effect`, default $XID_TAINT_EFFECT as in the plugin's pod). The NVML
recovery actions that taint a GPU (every device of it) come from the running plugin,
which alone knows them (its /status over its status socket, `--socket`); without an
answer the last line says they are unknown. The rule is docs/health.md's "What unhealthy means".

The table has one row per GPU, also for a GPU of which nothing is published (DEVICE
`-`), and with --partitions one per partition after its GPU. INDEX and PCI BUS ID are
the GPU's; UUID is the row's device as NVML names it (`-`: a MIG device created at
prepare); MIG the GPU's MIG mode (unsupported, disabled, dynamic, static, ignored);
PROFILE and PLACEMENT the MIG profile and memory slices a device is delivered as;
PARTITIONS, on GPU rows, how many partitions of the GPU are published. SHARING says
`MPS limits per process (cooperative)` where MPS daemons hold a share's or partition's
limits (MPS_DAEMONS), and lines under the table say what those limits do not hold: they
bind each CUDA process, not the claim; a process that bypasses MPS is not limited; a
fatal fault in one process can end the others of its claim; the servers of different
claims on a GPU are time-sliced; at most 48 clients per server; the servers' own
contexts overcommit the published memory (docs/mps.md).

Run it in the plugin's pod for real health:

    kubectl exec -n <ns> <plugin-pod> -- gpu-dra inventory
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import yaml

from driver.cli.arguments import add_command, add_output_argument
from driver.cli.output import format_table
from driver.cli.plugin_endpoint import (
    PluginUnreachable,
    add_socket_argument,
    fetch_status,
    recovery_failures,
    socket_path,
)
from driver.cli.state_dir import STATE_DIR_ENV, HealthView, add_state_dir_argument, read_health
from driver.devices.gpu_view import GpuView
from driver.devices.model import PoolDevices, PoolError, PublishedDevice, build_pool
from driver.devices.slices import build_slice_documents, validate_slice_specs
from driver.devices.table import HEADERS, device_rows, health_of_taints, mps_note
from driver.errors import DriverError
from driver.nvml.discovered import Inventory
from driver.nvml.library import NvmlUnavailableError
from driver.nvml.selection import select_backend
from driver.observability.logs import stderr_handler
from driver.plugin.options.settings import (
    NODE_NAME,
    NODE_SETTINGS,
    NodeSettings,
    SettingError,
    add_settings,
    node_settings,
    read_settings,
)
from driver.state.journal.checkpoint import Checkpoint
from driver.state.mig_instances import Held, owned_instances

log = logging.getLogger(__name__)


HELP = (
    "discover GPUs and show what this node would publish: a table, or the "
    "ResourceSlices (-o yaml, -o json)"
)


def add_parser(subcommands: Any) -> None:
    parser = add_command(subcommands, "inventory", __doc__, HELP)
    parser.add_argument(
        "--mock",
        nargs="?",
        const="",
        default=None,
        metavar="FLEET",
        help="mock GPUs: short for --nvml-backend=mock [--mock-fleet=FLEET]",
    )
    add_settings(parser, NODE_SETTINGS, default_text={NODE_NAME.dest: "this host's name"})
    parser.add_argument("--node-uid", default=None, help="Node UID for the slices' ownerReferences")
    parser.add_argument(
        "--partitions", action="store_true", help="table output: also list partitions"
    )
    add_output_argument(parser)
    add_state_dir_argument(parser, default=None)
    add_socket_argument(parser)
    parser.set_defaults(run=run)


def read_inventory_settings(args: argparse.Namespace) -> NodeSettings:
    """The plugin's settings from the flags, else the environment (the plugin pod's);
    SettingError naming a bad one."""
    given = dict(vars(args))
    if args.mock is not None:
        given["nvml_backend"] = "mock"
        given["mock_fleet"] = args.mock or given.get("mock_fleet")
    values = read_settings(argparse.Namespace(**given), NODE_SETTINGS)
    values[NODE_NAME.dest] = values[NODE_NAME.dest] or socket.gethostname()
    return node_settings(values)


def plugin_state_dir(args: argparse.Namespace, settings: NodeSettings) -> Path:
    """--state-dir, else $GPU_DRA_STATE_DIR, else the plugin's data dir."""
    return Path(args.state_dir or os.environ.get(STATE_DIR_ENV) or settings.data_dir)


def mock_driver_root(
    args: argparse.Namespace, settings: NodeSettings, state_dir: Path
) -> Path | None:
    """Where the plugin keeps the mock's MIG state; None (an in-memory mock) where
    there is none: a command that only reads never creates it. A fleet named by
    `--mock FLEET` is not the plugin's: its mock starts without MIG devices, unless
    `--mock-driver-root` is given too."""
    if args.mock:
        return settings.mock_driver_root if args.mock_driver_root is not None else None
    if settings.mock_driver_root is not None:
        return settings.mock_driver_root
    plugins = state_dir / "mock-driver-root"
    return plugins if plugins.is_dir() else None


def owned_mig_devices(state_dir: Path, inventory: Inventory) -> Held:
    """The MIG devices the plugin created for prepared claims (its journal), which it
    publishes as the dynamic partitions they are, not as static devices. A corrupt
    journal owns nothing, as in the plugin."""
    try:
        journal = Checkpoint(state_dir).load()
    except DriverError as err:  # corrupt, or not readable by this user
        print(f"gpu-dra inventory: the plugin's journal: {err}", file=sys.stderr)
        return frozenset()
    live = [m for g in inventory.gpus for m in g.mig_instances]
    return owned_instances(journal, live)


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        handler = stderr_handler("%(levelname)s %(name)s: %(message)s")
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    try:
        settings = read_inventory_settings(args)
    except SettingError as err:
        print(f"gpu-dra inventory: {err}", file=sys.stderr)
        return 1
    state_dir = plugin_state_dir(args, settings)
    try:
        backend = select_backend(
            mock=settings.mock,
            fleet_path=settings.mock_fleet,
            node_name=settings.node_name,
            mock_driver_root=mock_driver_root(args, settings, state_dir) if settings.mock else None,
            driver_root=settings.nvidia_driver_root,
        )
        inventory = backend.discover()
    except (NvmlUnavailableError, ValueError) as err:  # a bad fleet file is a ValueError
        print(f"gpu-dra inventory: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        print(f"gpu-dra inventory: NVML discovery failed: {err}", file=sys.stderr)
        return 1
    owned = owned_mig_devices(state_dir, inventory)
    try:
        pool = build_pool(inventory, settings.pool_options(), owned_mig=owned)
    except PoolError as err:
        print(f"gpu-dra inventory: {err}", file=sys.stderr)
        return 1
    for note in pool.notes:
        print(f"gpu-dra inventory: {note}", file=sys.stderr)
    docs = build_slice_documents(
        pool, driver=settings.driver_name, node_name=settings.node_name, node_uid=args.node_uid
    )
    problems = validate_slice_specs([d["spec"] for d in docs])
    if problems:
        for p in problems:
            print(f"gpu-dra inventory: invalid slice: {p}", file=sys.stderr)
        return 1
    if args.output == "table":
        health = _health_view(args, state_dir, settings.driver_name)
        if health is None:
            return 1
        recovery, recovery_source = _recovery_actions(socket_path(args.socket, state_dir))
        sys.stdout.write(
            _table(
                inventory,
                pool,
                health,
                recovery,
                driver=settings.driver_name,
                effect=settings.xid_taint_effect,
                partitions=args.partitions,
            )
        )
        n_devices = len(pool.devices)
        print(
            f"\n{len(inventory.gpus)} GPU(s), {n_devices} device(s) in {len(docs)} slice(s) "
            f"({inventory.backend}, driver {inventory.driver_version})"
        )
        sys.stdout.write(mps_note(pool.devices))
        if health.unknown is not None:
            print(f"health unknown: {health.unknown} (give --state-dir)")
        else:
            print(f"health from {health.path}")
        print(recovery_source)
    elif args.output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}, indent=2))
    else:
        sys.stdout.write(
            yaml.dump_all(docs, Dumper=NoAliasDumper, sort_keys=False, explicit_start=True)
        )
    return 0


class NoAliasDumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """Writes a shared object in full each time: no `&id001` anchors and `*id001`
    aliases, which kubectl and people reading the output do not expect."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _health_view(args: argparse.Namespace, state_dir: Path, driver: str) -> HealthView | None:
    """The plugin's recorded health; None (after a message) for a --state-dir given
    explicitly that is not a directory."""
    if args.state_dir is not None and not state_dir.is_dir():
        print(f"gpu-dra inventory: --state-dir {state_dir}: no such directory", file=sys.stderr)
        return None
    return read_health(state_dir, driver)


def _recovery_actions(status_socket: Path) -> tuple[dict[str, dict[str, Any]], str]:
    """The running plugin's recovery actions by GPU UUID, and where they came from (or
    why they are unknown) for the table's last line."""
    try:
        found = recovery_failures(fetch_status(status_socket))
    except PluginUnreachable as err:
        return {}, f"recovery actions unknown: the plugin does not answer: {err}"
    return found, f"recovery actions from the plugin at {status_socket}"


def _table(
    inventory: Inventory,
    pool: PoolDevices,
    health: HealthView,
    recovery: dict[str, dict[str, Any]],
    *,
    driver: str,
    effect: str,
    partitions: bool,
) -> str:
    """`recovery`: GPU UUID -> the recovery action that taints every device of it
    (`recovery_failures`)."""
    store = health.store

    def health_text(device: PublishedDevice | GpuView) -> str:
        if store is None:
            return "unknown"
        taints = list(
            store.device_taints([device], driver=driver, effect=effect).get(device.name, ())
        )
        action = recovery.get(device.gpu_uuid)
        if action is not None:
            taints.append(action)
        return health_of_taints(taints)

    return format_table(HEADERS, device_rows(inventory, pool, health_text, partitions=partitions))
