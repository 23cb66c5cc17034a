"""`gpu-dra inventory`: discover GPUs and print the ResourceSlices this node would publish.

Without --mock, real NVML (pynvml) is used; --mock uses a mock fleet instead: a fleet
YAML file, a built-in fleet name (`default`: 8 x H100-80GB with MIG, `example`: the Go
reference's 8 devices), or nothing for the default fleet. Output: a table of GPUs
(default; `--partitions` lists partitions too) or the ResourceSlice documents (yaml,
json).

The table's HEALTH column comes from the health store of the plugin on this node
(`<state dir>/health.json`, read only): `--state-dir DIR`, else $GPU_DRA_STATE_DIR,
else the plugin's standard data dir /var/lib/kubelet/plugins/<driver name> if it
exists. Without one, HEALTH says `unknown`: inventory never claims a GPU is healthy
without reading what the plugin recorded. Run it in the plugin's pod for real health:

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

from driver.cli.output import format_table
from driver.cli.state_dir import (
    HealthView,
    add_state_dir_argument,
    default_state_dir,
    read_health,
)
from driver.devices.model import (
    DEFAULT_DRIVER_NAME,
    MigStrategy,
    PoolDevices,
    PoolError,
    PoolOptions,
    build_pool,
)
from driver.devices.slices import build_slice_documents, validate_slice_specs
from driver.devices.table import HEADERS, device_rows
from driver.nvml.backend import select_backend
from driver.nvml.library import NvmlUnavailableError
from driver.plugin.flags import non_negative_int
from driver.plugin.host_inputs import driver_name_argument

log = logging.getLogger(__name__)


def add_parser(subcommands: Any) -> None:
    parser: argparse.ArgumentParser = subcommands.add_parser(
        "inventory",
        help="discover GPUs and print the ResourceSlices this node would publish",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--mock",
        nargs="?",
        const="",
        default=None,
        metavar="FLEET.yaml",
        help="use the mock NVML with this fleet (file or built-in name; default fleet if empty)",
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="node name: pool name, slice owner and mock UUID seed (default: $NODE_NAME or host)",
    )
    parser.add_argument("--node-uid", default=None, help="Node UID for the slices' ownerReferences")
    parser.add_argument(
        "--driver-name",
        type=driver_name_argument,
        default=DEFAULT_DRIVER_NAME,
        help="DRA driver name (default: %(default)s)",
    )
    parser.add_argument(
        "--gpu-partitions",
        type=non_negative_int("--gpu-partitions"),
        default=0,
        metavar="N",
        help="publish N equal partitions per GPU like the Go reference, instead of MIG",
    )
    parser.add_argument(
        "--gpu-allow-multiple-allocations",
        action="store_true",
        help="publish whole GPUs (and --gpu-partitions partitions) as shareable by "
        "consumable capacity, as the plugin flag of the same name does",
    )
    parser.add_argument(
        "--mig-strategy",
        choices=[m.value for m in MigStrategy],
        default=MigStrategy.AUTO.value,
        help="GPUs in MIG mode: auto (static where MIG devices exist, else dynamic), "
        "dynamic or static (default: %(default)s)",
    )
    parser.add_argument(
        "--partitions", action="store_true", help="table output: also list partitions"
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("table", "yaml", "json"),
        default="table",
        help="output format (default: %(default)s)",
    )
    add_state_dir_argument(parser, default=None)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        backend = select_backend(
            mock=args.mock is not None,
            fleet_path=args.mock or None,
            node_name=args.node_name,
        )
        inventory = backend.discover()
    except (NvmlUnavailableError, ValueError) as err:  # a bad fleet file is a ValueError
        print(f"gpu-dra inventory: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        print(f"gpu-dra inventory: NVML discovery failed: {err}", file=sys.stderr)
        return 1
    options = PoolOptions(
        driver_name=args.driver_name,
        gpu_partitions=args.gpu_partitions,
        mig_strategy=MigStrategy(args.mig_strategy),
        allow_multiple_allocations=args.gpu_allow_multiple_allocations,
    )
    try:
        pool = build_pool(inventory, options)
    except PoolError as err:
        print(f"gpu-dra inventory: {err}", file=sys.stderr)
        return 1
    for note in pool.notes:
        print(f"gpu-dra inventory: {note}", file=sys.stderr)
    docs = build_slice_documents(
        pool, driver=args.driver_name, node_name=args.node_name, node_uid=args.node_uid
    )
    problems = validate_slice_specs([d["spec"] for d in docs])
    if problems:
        for p in problems:
            print(f"gpu-dra inventory: invalid slice: {p}", file=sys.stderr)
        return 1
    if args.output == "table":
        health = _health_view(args)
        if health is None:
            return 1
        sys.stdout.write(_table(pool, health, driver=args.driver_name, partitions=args.partitions))
        n_devices = len(pool.devices)
        print(
            f"\n{len(inventory.gpus)} GPU(s), {n_devices} device(s) in {len(docs)} slice(s) "
            f"({inventory.backend}, driver {inventory.driver_version})"
        )
        if health.unknown is not None:
            print(f"health unknown: {health.unknown} (give --state-dir)")
        else:
            print(f"health from {health.path}")
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


def _health_view(args: argparse.Namespace) -> HealthView | None:
    """The plugin's recorded health; None (after a message) for a --state-dir given
    explicitly that is not a directory."""
    if args.state_dir is not None:
        state_dir = Path(args.state_dir)
        if not state_dir.is_dir():
            print(f"gpu-dra inventory: --state-dir {state_dir}: no such directory", file=sys.stderr)
            return None
    else:
        state_dir = default_state_dir(args.driver_name)
    return read_health(state_dir, args.driver_name)


def _table(pool: PoolDevices, health: HealthView, *, driver: str, partitions: bool) -> str:
    taints = None
    if health.store is not None:
        taints = health.store.device_taints(pool.devices, driver=driver)
    rows = device_rows(pool, taints, partitions=partitions)
    if health.store is None:
        rows = [(*row[:-1], "unknown") for row in rows]
    return format_table(HEADERS, rows)
