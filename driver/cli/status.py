"""`gpu-dra status`: this node's kubelet plugin at a glance.

The plugin's version, its registration with the kubelet, the last ResourceSlice
sync, every GPU with its MIG mode and health, the prepared claims and the state of
the prepare journal, whether the MPS daemons of prepared claims run, from the
running plugin's /status over its status socket (`--socket`, default
`<state dir>/status.sock`; root only). When the plugin does not
answer, what this node's files say (`--state-dir`: the health store and the journal)
and that the plugin is not reachable.

The first line is the verdict: `OK: ...` or `UNHEALTHY: <first problem>`, which a
node-problem-detector custom plugin shows as the condition's message:

    kubectl exec -n <ns> <plugin-pod> -- gpu-dra status
    gpu-dra status --fail-on-unhealthy     # exit 1 while a problem is listed

Exit codes: 0 shown (healthy or not, unless --fail-on-unhealthy); 1 with
--fail-on-unhealthy when a problem is listed (the plugin not answering included);
2 usage error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from driver.cli.arguments import add_command, add_output_argument, add_state_arguments
from driver.cli.health.health_table import taint_text
from driver.cli.output import format_table, print_report, std_streams
from driver.cli.plugin_endpoint import (
    PluginUnreachable,
    add_socket_argument,
    fetch_status,
    socket_path,
)
from driver.cli.state_dir import read_health, state_dir_of
from driver.health.clear import record_json
from driver.plugin.journal_summary import JournalSummary, summarise
from driver.state.journal.checkpoint import Checkpoint

GPU_HEADERS = ("GPU", "INDEX", "PCI BUS ID", "UUID", "MODEL", "MIG", "HEALTH")


HELP = "this node's plugin at a glance: registration, sync, GPUs, claims, health"


def add_parser(subcommands: Any) -> None:
    parser = add_command(subcommands, "status", __doc__, HELP)
    add_socket_argument(parser)
    add_state_arguments(
        parser, "DRA driver name, for the default --state-dir (default: %(default)s)"
    )
    parser.add_argument(
        "--fail-on-unhealthy",
        action="store_true",
        help="exit 1 when a problem is listed (node-problem-detector style checks)",
    )
    add_output_argument(parser)
    parser.set_defaults(run=run)


@std_streams
def run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    state_dir = state_dir_of(args)
    try:
        document = fetch_status(socket_path(args.socket, state_dir))
        report = {"reachable": True, "problem": None, **document}
    except PluginUnreachable as error:
        report = local_report(state_dir, args.driver_name, f"the plugin does not answer: {error}")
    print_report(report, args.output, out, render)
    return 1 if args.fail_on_unhealthy and report["problems"] else 0


def local_report(state_dir: Path, driver: str, why: str) -> dict[str, Any]:
    """What the node's files say while the plugin does not answer: `problems` starts
    with `why`."""
    journal = (
        summarise(Checkpoint(state_dir))
        if state_dir.is_dir()
        else JournalSummary("unreadable", f"no plugin data directory {state_dir}", None, None, None)
    )
    view = read_health(state_dir, driver)
    failures = []
    if view.store is not None:
        for uuid, failure in sorted(view.store.failed_gpus().items()):
            failures.append(record_json(uuid, failure))
        for uuid, by_placement in sorted(view.store.failed_instances().items()):
            failures += [record_json(uuid, f) for _, f in sorted(by_placement.items())]
    problems = [why]
    if view.unknown is not None:
        problems.append(f"health store: {view.unknown}")
    problems += [f"{f['gpuUUID']} failed: {f['message']}" for f in failures]
    if journal.status in ("corrupt", "unreadable"):
        problems.append(f"prepare journal {journal.status}: {journal.problem}")
    return {
        "reachable": False,
        "problem": why,
        "stateDir": str(state_dir),
        "health": {"storeProblem": view.unknown, "failures": failures},
        "journal": journal.to_json(),
        "problems": problems,
        "healthy": False,
    }


def _verdict(report: dict[str, Any]) -> str:
    problems: list[str] = report["problems"]
    if not problems:
        gpus = report.get("gpus") or []
        return f"OK: {len(gpus)} GPU(s) healthy, plugin registered, slices in sync"
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"UNHEALTHY: {problems[0]}{more}"


def _journal_line(journal: dict[str, Any]) -> str:
    if journal["status"] in ("ok", "absent"):
        text = (
            f"{journal['status']}: {journal['preparedClaims']} claim(s) prepared "
            f"({journal['preparedDevices']} device(s)), {journal['preparingClaims']} being prepared"
        )
    else:
        text = f"{journal['status'].upper()}: {journal['problem']}"
    if journal.get("prepareRefused"):
        text += f"; prepare refused: {journal['prepareRefused']}"
    return text


def _mps_line(mps: dict[str, Any]) -> str:
    if mps["checkedAt"] is None:
        return "not checked yet"
    daemons = mps["daemons"]
    down = sum(not d["running"] for d in daemons)
    text = f"{len(daemons)} daemon(s): {len(daemons) - down} running"
    return text + (f", {down} NOT RUNNING" if down else "") + f" (checked {mps['checkedAt']})"


def _gpu_health(gpu: dict[str, Any]) -> str:
    unmonitored = "" if gpu.get("monitored", True) else " (unmonitored)"
    if gpu["health"] != "failed":
        return f"{gpu['health']}{unmonitored}"
    return "failed: " + "; ".join(f["message"] for f in gpu["failures"]) + unmonitored


def _tainted_text(health: dict[str, Any]) -> str:
    """How many devices are tainted, with each taint's own effect (a plugin before
    `taints` was reported: the effect --xid-taint-effect gives a failure's taint)."""
    text = f"{health['taintedDevices']} device(s) tainted"
    taints = health.get("taints")
    if not taints:
        return f"{text} (--xid-taint-effect {health['taintEffect']})"
    return f"{text}: " + ", ".join(f"{taint_text(t)} on {t['devices']}" for t in taints)


def _gpu_row(gpu: dict[str, Any]) -> tuple[str, ...]:
    return (
        gpu["name"],
        str(gpu["index"]),
        gpu["pciBusID"],
        gpu["uuid"],
        gpu["model"],
        gpu["migMode"],
        _gpu_health(gpu),
    )


def render(report: dict[str, Any]) -> str:
    lines = [_verdict(report), ""]
    if not report["reachable"]:
        lines.append(f"plugin        NOT REACHABLE: {report['problem']}")
        lines.append(f"journal       {_journal_line(report['journal'])} ({report['stateDir']})")
        failures = report["health"]["failures"]
        lines.append(f"health        {len(failures)} recorded failure(s) (health store)")
    else:
        plugin, slices, health = report["plugin"], report["slices"], report["health"]
        lines.append(
            f"plugin        version {plugin['version']} (pid {plugin['pid']}), node "
            f"{plugin['node']}, driver {plugin['driver']}, up {plugin['uptimeSeconds']}s"
        )
        registration = report["registration"]
        if registration.get("error"):
            shown = f"REFUSED: {registration['error']}"
        else:
            shown = "registered" if registration["registered"] else "NOT registered"
        lines.append(f"registration  {shown}")
        if slices["lastSynced"] is None:
            synced = "not published yet"
        else:
            synced = f"last in sync {slices['lastSynced']} ({slices['ageSeconds']:.0f}s ago)"
        error = f"; last error: {slices['lastError']}" if slices["lastError"] else ""
        lines.append(f"slices        {slices['publishedDevices']} device(s), {synced}{error}")
        lines.append(
            f"health        {health['failedGPUs']} GPU(s) failed, {_tainted_text(health)}"
            + (f"; STORE CORRUPT: {health['storeProblem']}" if health["storeProblem"] else "")
            + (
                f"; {health['unmonitoredGPUs']} GPU(s) NOT MONITORED"
                if health.get("unmonitoredGPUs")
                else ""
            )
        )
        lines.append(f"journal       {_journal_line(report['journal'])}")
        if report.get("mps") is not None:
            lines.append(f"mps           {_mps_line(report['mps'])}")
        rows = [_gpu_row(g) for g in report["gpus"]]
        if rows:
            lines += ["", format_table(GPU_HEADERS, rows).rstrip("\n")]
    if report["problems"] or report.get("notes"):
        lines.append("")
        lines += [f"problem: {p}" for p in report["problems"]]
        lines += [f"note: {n}" for n in report.get("notes") or []]
    return "\n".join(lines) + "\n"
