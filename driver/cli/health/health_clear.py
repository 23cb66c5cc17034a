"""`gpu-dra health clear DEVICE`: forget a GPU's (or a MIG partition's) failure after
a repair, so that its taint is removed from this node's ResourceSlices.

The running kubelet plugin does it, never this command: the request goes to the
plugin's status socket (`POST /control/clear` on `<state dir>/status.sock`, root
only; `--socket`), with any NVML backend. First the plugin answers what a clear would
remove (nothing changes), this command shows it and asks for confirmation (`--yes`
skips it; without a terminal `--yes` is required); then the plugin clears exactly
that (refused if the failures changed meanwhile), republishes and says whether the
API server accepted the slices.

DEVICE: `gpu-<n>` or a GPU UUID (the GPU and all its GPU instances, as NVML's
recovery event does), or a MIG partition (the failures of GPU instances on its memory
slices; refused when the whole GPU failed). If the fault persists, the next NVML
event taints the device again. A taint of NVML's recovery action (a reset, a reboot)
is not a recorded failure: it stays until NVML reports no action, and the command
says so.

Exit codes: 0 cleared (and the slices accepted) or nothing to clear; 1 refused, not
confirmed, no plugin accepts `clear`, not taken within --timeout, or cleared but the
slices not yet accepted; 2 usage error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from driver.cli.arguments import add_command, add_state_arguments, positive_seconds
from driver.cli.confirm import NotConfirmed, add_yes_argument, confirm
from driver.cli.output import std_streams
from driver.cli.plugin_endpoint import (
    ControlRefused,
    PluginUnreachable,
    add_socket_argument,
    fetch_control,
    post_control,
    socket_path,
)
from driver.cli.state_dir import default_state_dir

PROG = "gpu-dra health clear"
DEFAULT_TIMEOUT = 15.0


class ClearFailed(Exception):
    """No answer, or the plugin refused; the message says why."""


HELP = "forget a repaired GPU's or partition's failure: its taint is removed"


def add_parser(actions: Any) -> None:
    parser = add_command(actions, "clear", __doc__, HELP)
    parser.add_argument("device", help="gpu-<n>, a GPU UUID, or a MIG partition name")
    add_state_arguments(parser)
    add_socket_argument(parser)
    add_yes_argument(parser)
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT,
        help=(
            "seconds the plugin has to take each request, else it is withdrawn "
            "(default: %(default)s)"
        ),
    )
    parser.set_defaults(run=run)


@std_streams
def run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir(args.driver_name)
    path = socket_path(args.socket, state_dir)
    try:
        plugin = _plugin(path)
        preview = _ask(path, {"device": args.device, "dryRun": True}, args)
    except ClearFailed as error:
        print(f"{PROG}: {error}", file=err)
        return 1
    plan = preview["plan"]
    if not plan["records"]:
        print(preview["message"], file=out)
        return 0
    out.write(describe(plan, pid=plugin.get("pid"), node=str(plugin.get("node") or "")))
    try:
        confirm("Clear it?", yes=args.yes, stdin=stdin, out=out)
    except NotConfirmed as error:
        print(f"{PROG}: {error}", file=err)
        return 1
    request = {"device": args.device, "dryRun": False, "expect": plan["records"]}
    try:
        answer = _ask(path, request, args)
    except ClearFailed as error:
        print(f"{PROG}: {error}", file=err)
        return 1
    print(answer["message"], file=out)
    published = answer.get("published")
    if published is False:
        print(
            f"{PROG}: the failure is cleared in the plugin, but the API server has not yet "
            "accepted the ResourceSlices without the taint; the plugin keeps retrying "
            "(check with `gpu-dra health`)",
            file=err,
        )
        return 1
    if published:
        print(
            f"the API server accepted this node's ResourceSlices without {_removed(plan)}", file=out
        )
    if plan.get("keptTaint"):
        print(
            f"{plan['gpuDevices']} device(s) still carry {plan['keptTaint']}: it goes by "
            "itself once NVML reports no recovery action",
            file=out,
        )
    return 0


def _removed(plan: dict[str, Any]) -> str:
    """`<key>=<value>, ...`: the taints of the records the clear forgets."""
    names = (
        f"{r['key']}={r['value']}" if r.get("value") else str(r["key"]) for r in plan["records"]
    )
    return ", ".join(dict.fromkeys(names))


def _plugin(path: Path) -> dict[str, Any]:
    """The running plugin (`GET /control`); ClearFailed unless it accepts `clear`."""
    try:
        plugin = fetch_control(path)
    except PluginUnreachable as err:
        raise ClearFailed(f"no kubelet plugin answers: {err}") from None
    actions = plugin.get("actions") or []
    if "clear" not in actions:
        raise ClearFailed(
            f"the running plugin (pid {plugin.get('pid', '?')}) does not accept 'clear': "
            f"it accepts: {', '.join(map(str, actions)) or 'none'}"
        )
    return plugin


def _ask(path: Path, request: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The plugin's answer; ClearFailed when it refused or did not answer."""
    try:
        answer = post_control(path, "clear", request, timeout=args.timeout)
    except PluginUnreachable as err:
        raise ClearFailed(f"no answer from the plugin: {err}") from None
    except ControlRefused as err:
        raise ClearFailed(f"the plugin refused: {err}") from None
    if not isinstance(answer.get("plan"), dict):
        raise ClearFailed(f"unexpected answer from the plugin: {answer!r}")
    return answer


def describe(plan: dict[str, Any], *, pid: int | None, node: str) -> str:
    """What the clear will do, in words."""
    where = f" on node {node}" if node else ""
    lines = [
        f"The kubelet plugin (pid {pid if pid is not None else '?'}){where} will forget "
        f"{'this failure' if len(plan['records']) == 1 else 'these failures'} of "
        f"{plan['target']} ({plan['gpuUUID']}):"
    ]
    lines += [f"  - {record['message']}" for record in plan["records"]]
    untainted = ", ".join(plan["untaintedDevices"]) or "none"
    lines.append(
        f"and republish this node's ResourceSlices without {_removed(plan)} on: {untainted}"
    )
    if plan["stillTaintedDevices"]:
        lines.append(
            "still tainted afterwards (other failures of the GPU): "
            + ", ".join(plan["stillTaintedDevices"])
        )
    if plan.get("keptTaint"):
        lines.append(
            f"stay tainted afterwards: all {plan['gpuDevices']} device(s) keep "
            f"{plan['keptTaint']}: NVML's recovery action, which goes by itself once NVML "
            "reports none; gpu-dra health clear does not remove it"
        )
    lines.append(
        "The scheduler may then allocate these devices again. If the fault persists, the "
        "next NVML event taints them again."
    )
    return "\n".join(lines) + "\n"
