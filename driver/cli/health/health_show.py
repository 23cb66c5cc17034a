"""`gpu-dra health`: this node's GPU health and taints, with their reasons and sources.

Three sources, each line says which:

- `store`: the failures the kubelet plugin recorded in its health store
  (`<state dir>/health.json`, read only): why a GPU or a MIG GPU instance is unhealthy
  and since when. This is what the plugin publishes from.
- `slices`: the taints this node's ResourceSlices carry in the API server (what the
  scheduler sees), one line per tainted GPU (`--devices`: per device and taint), when
  an API server is reachable (`--kubeconfig`, $KUBECONFIG, the
  in-cluster service account, ~/.kube/config). A difference between the two is
  shown as a note: the plugin republishes within seconds, so a lasting difference
  means it is not running or cannot write.
- `plugin`: the NVML recovery actions that taint a GPU (a reset, a reboot, a drain
  it needs), which only the running plugin knows (it reads NVML and keeps them in
  memory): from its /status (its status socket, `--socket`). Such a GPU is unhealthy as one with a
  recorded failure is; its taint goes by itself once NVML answers no action.

Devices are named as the slices publish them; when the slices cannot be read, as
the running plugin names them (its /status), else by NVML on this
node, else from the NVIDIA kernel driver's /proc files (`gpu-<minor>`).

Also shown: whether a plugin is running on this node (its status socket's
`/control`) and whether it accepts `gpu-dra health clear`.

    kubectl exec -n <ns> <plugin-pod> -- gpu-dra health
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra health -o json
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra health clear gpu-3
    gpu-dra health --all-nodes      # every node's tainted GPUs, from the API server

Exit codes: 0 shown (failures or not), 1 neither source could be read (with
--all-nodes: the API server could not be read, or --fail-on-unhealthy and a GPU is
unhealthy), 2 usage error.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from driver.cli.arguments import add_command, add_output_argument, add_state_arguments
from driver.cli.health import health_clear, health_nodes
from driver.cli.health.gpu_names import local_gpu_names
from driver.cli.health.gpu_taints import taints_by_gpu
from driver.cli.health.health_table import render_table, taint_text
from driver.cli.output import print_report, std_streams
from driver.cli.plugin_endpoint import (
    PluginUnreachable,
    add_socket_argument,
    fetch_control,
    fetch_status,
    recovery_failures,
    socket_path,
)
from driver.cli.published import PublishedView, SliceDevice, read_published
from driver.cli.state_dir import HealthView, read_health, state_dir_of
from driver.health.clear import record_json
from driver.health.failures import KIND_RANK, GpuFailure
from driver.health.recovery_taints import KIND_RECOVERY_ACTION
from driver.health.unmonitored import KIND_UNMONITORED

UNMONITORED_REASON = (
    "NVML does not report this GPU's health events: its failures go unseen "
    "(informational; `gpu-dra status` says why)"
)


HELP = (
    "show GPU health and taints with their reasons, of this node or of every "
    "node (--all-nodes); clear: after a repair"
)


def add_parser(subcommands: Any) -> None:
    parser = add_command(subcommands, "health", __doc__, HELP)
    add_state_arguments(parser)
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="the node whose ResourceSlices are read (default: $NODE_NAME or host name)",
    )
    parser.add_argument(
        "--kubeconfig", default=None, help="kubeconfig for reading the node's ResourceSlices"
    )
    parser.add_argument(
        "--allow-insecure-http",
        action="store_true",
        help="send the kubeconfig's token to an http:// server (readable on the network)",
    )
    add_output_argument(parser)
    parser.add_argument(
        "--devices",
        action="store_true",
        help="list every published device taint (default: one line per tainted GPU)",
    )
    parser.add_argument(
        "--all-nodes",
        action="store_true",
        help="every node's tainted GPUs from the API server, one line per GPU "
        "(reads no node files)",
    )
    parser.add_argument(
        "--fail-on-unhealthy",
        action="store_true",
        help="with --all-nodes: exit 1 while any GPU is unhealthy",
    )
    add_socket_argument(parser)
    parser.set_defaults(run=run)
    actions = parser.add_subparsers(dest="health_action", metavar="ACTION")
    health_clear.add_parser(actions)


@dataclass(frozen=True)
class PluginRecovery:
    """The running plugin's recovery actions that taint GPUs, or why they are unknown."""

    failures: dict[str, dict[str, Any]]  # GPU UUID -> RecoveryFailure.to_json()
    problem: str | None = None

    @classmethod
    def read(cls, status_socket: Path) -> PluginRecovery:
        try:
            return cls(recovery_failures(fetch_status(status_socket)))
        except PluginUnreachable as err:
            return cls({}, f"the plugin does not answer: {err}")


NOT_READ = PluginRecovery({}, "not read")


@std_streams
def run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    if args.all_nodes:
        return health_nodes.run(args, out, err)
    if args.fail_on_unhealthy:
        print(
            "gpu-dra health: --fail-on-unhealthy goes with --all-nodes (for this node: "
            "`gpu-dra status --fail-on-unhealthy`)",
            file=err,
        )
        return 2
    state_dir = state_dir_of(args)
    if args.state_dir is not None and not state_dir.is_dir():
        print(f"gpu-dra health: --state-dir {state_dir}: no such directory", file=err)
        return 1
    view = read_health(state_dir, args.driver_name)
    published = read_published(
        args.node_name,
        args.driver_name,
        args.kubeconfig,
        allow_insecure_http=args.allow_insecure_http,
    )
    status_socket = socket_path(args.socket, state_dir)
    names = published.gpu_names() if published.problem is None else None
    names_note = None
    if names is None and view.store is not None:
        local = local_gpu_names(status_socket)
        names = local.names
        names_note = f"from {local.source}" if local.source else f"GPU UUIDs: {local.problem}"
    report = build_report(
        args.node_name,
        args.driver_name,
        state_dir,
        view,
        published,
        gpu_names=names,
        names_note=names_note,
        recovery=PluginRecovery.read(status_socket),
        status_socket=status_socket,
    )
    print_report(report, args.output, out, lambda r: render_table(r, devices=args.devices))
    if view.store is None and published.problem is not None:
        print(
            f"gpu-dra health: nothing could be read: {view.unknown}; {published.problem}",
            file=err,
        )
        return 1
    return 0


def plugin_status(status_socket: Path) -> dict[str, Any]:
    """The running plugin as its status socket's `/control` describes it."""
    try:
        plugin = fetch_control(status_socket)
    except PluginUnreachable as error:
        return {"running": False, "problem": str(error)}
    actions = [str(a) for a in plugin.get("actions") or []]
    return {
        "running": True,
        "pid": plugin.get("pid"),
        "node": str(plugin.get("node", "")),
        "started": plugin.get("started"),
        "actions": actions,
        "acceptsClear": "clear" in actions,
        "problem": None,
    }


def build_report(
    node: str,
    driver: str,
    state_dir: Path,
    view: HealthView,
    published: PublishedView,
    *,
    gpu_names: dict[str, str] | None = None,
    names_note: str | None = None,
    recovery: PluginRecovery = NOT_READ,
    status_socket: Path | None = None,
) -> dict[str, Any]:
    """The JSON document `-o json` prints (the table shows the same). `gpu_names`:
    GPU UUID -> device name (default: the published whole-GPU devices'); `names_note`:
    where they came from when not from the slices, or why devices are shown by UUID;
    `status_socket`: the plugin's (default: the one in `state_dir`)."""
    names = published.gpu_names() if gpu_names is None else gpu_names
    failures: list[dict[str, Any]] = []
    if view.store is not None:
        for uuid, failure in sorted(view.store.failed_gpus().items()):
            failures.append(_store_line(uuid, failure, names))
        for uuid, by_placement in sorted(view.store.failed_instances().items()):
            for _, failure in sorted(by_placement.items()):
                failures.append(_store_line(uuid, failure, names))
    actions = sorted(
        ({**failure, "device": names.get(uuid)} for uuid, failure in recovery.failures.items()),
        key=lambda a: (
            a["device"] is None,
            len(a["device"] or ""),
            a["device"] or "",
            a["gpuUUID"],
        ),
    )
    taints: list[dict[str, Any]] = []
    for device in published.devices:
        stored = view.store.device_failure(device) if view.store is not None else None
        action = recovery.failures.get(device.gpu_uuid)
        for taint in device.taints:
            if taint.get("key") == f"{driver}/{KIND_RECOVERY_ACTION}":
                reason = action["message"] if action is not None else None
            elif taint.get("key") == f"{driver}/{KIND_UNMONITORED}":
                reason = UNMONITORED_REASON
            else:
                reason = stored.message() if stored is not None else None
            taints.append(
                {
                    "device": device.name,
                    "slice": device.slice_name,
                    "key": taint.get("key"),
                    "value": taint.get("value"),
                    "effect": taint.get("effect"),
                    "timeAdded": taint.get("timeAdded"),
                    "reason": reason,
                }
            )
    gpu_of = {d.name: d.gpu_uuid for d in published.devices}
    gpus = [
        {
            **gpu.to_json(driver),
            "reasons": list(
                dict.fromkeys(
                    t["reason"] for t in taints if t["reason"] and gpu_of[t["device"]] == gpu.uuid
                )
            ),
        }
        for gpu in taints_by_gpu(published.devices)
    ]
    notes = _differences(driver, view, published) if published.problem is None else []
    return {
        "node": node,
        "driver": driver,
        "stateDir": str(state_dir),
        "plugin": plugin_status(socket_path(status_socket, state_dir)),
        "store": {
            "path": str(view.path),
            "readable": view.store is not None,
            "problem": view.unknown,
            "failures": failures,
        },
        "recovery": {
            "read": recovery.problem is None,
            "problem": recovery.problem,
            "actions": actions,
        },
        "slices": {
            "read": published.problem is None,
            "source": published.source,
            "problem": published.problem,
            "taints": taints,
            "gpus": gpus,
        },
        "names": names_note,
        "consistent": None if view.store is None or published.problem is not None else not notes,
        "notes": notes,
    }


def _store_line(uuid: str, failure: GpuFailure, names: dict[str, str]) -> dict[str, Any]:
    line = record_json(uuid, failure)
    line["device"] = names.get(uuid)
    line["scope"] = "gpu" if failure.whole_gpu else "instance"
    return line


def _differences(driver: str, view: HealthView, published: PublishedView) -> list[str]:
    """Where the published taints are not what the store says they should be."""
    if view.store is None:
        return []
    notes: list[str] = []
    for device in published.devices:
        failure = view.store.device_failure(device)
        recorded_kinds = set(KIND_RANK) | ({failure.kind} if failure is not None else set())
        ours = {
            (t.get("key"), t.get("value"))
            for t in device.taints
            if str(t.get("key", "")).removeprefix(f"{driver}/") in recorded_kinds
        }
        want = set() if failure is None else {(f"{driver}/{failure.kind}", failure.value)}
        if ours == want:
            continue
        if failure is None:
            notes.append(
                f"{device.name}: a taint is published but no failure is recorded (the plugin "
                "removes it when it publishes next; if it stays, no plugin is publishing)"
            )
        else:
            notes.append(
                f"{device.name}: {failure.message()} is recorded but "
                f"{_taint_text(device) or 'no taint'} is published (the plugin publishes it "
                "within seconds; if it stays, no plugin is publishing)"
            )
    return notes


def _taint_text(device: SliceDevice) -> str:
    return ", ".join(taint_text(t) for t in device.taints)
