"""`gpu-dra journal show|quarantine`: the kubelet plugin's prepare journal
(`<state dir>/checkpoint.json` and the log of the stores since, `checkpoint.log`;
docs/state.md).

`show` (read only, safe while the plugin runs: the plugin replaces the snapshot
atomically and appends whole records to the log, and a record being appended is not
shown yet) lists the prepared claims as the snapshot and the log's records give them,
their devices and MIG records, what the plugin does with each entry, whether each
claim's CDI spec is in place, how many log records are pending (folded into the
snapshot at the plugin's next clean stop or start), and whether the journal is
corrupt (then why, and the entries as stored, unverified, where the files still
parse). Permanent prepare verdicts are not in the journal: the plugin keeps them in
memory only.

`quarantine` moves a corrupt journal aside to `checkpoint.json.corrupt-<UTC time>`
and `checkpoint.log.corrupt-<UTC time>` (never deletes them) so the plugin can
prepare again from an empty journal; a run killed or failed half way is finished, as
confirmed, by the next run or the plugin's start.
When the corrupt file's readable entries own MIG devices the driver created, it
refuses until `--owned-mig` says what becomes of them: `adopt` (carried into the new
journal: their claims keep them, their unprepare destroys them), `destroy` (the
plugin's next start destroys them and removes those claims' CDI specs) or `foreign`
(left as an administrator's; docs/state.md, "MIG devices after a quarantine").
It refuses a valid journal, and refuses while a kubelet plugin runs on the node
(it holds `<state dir>/instances.lock`): stop the plugin on this node first. It
shows what the plugin will do on its next start and asks for confirmation (`--yes`
skips it; without a terminal `--yes` is required).

Exit codes: show: 0 readable or absent, 1 corrupt or unreadable. quarantine: 0 moved
aside or no journal, 1 refused or not confirmed. 2: usage error.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, TextIO

from driver.cdi.claim_specs import CdiSpecs
from driver.cli.arguments import add_command, add_output_argument
from driver.cli.journal import journal_quarantine
from driver.cli.journal.journal_args import (
    add_common_arguments,
    cdi_root_of,
    cdi_specs,
    state_dir_of,
)
from driver.cli.output import format_table, print_report, std_streams
from driver.errors import DriverError
from driver.state.journal.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
)
from driver.state.journal.journal_entries import boot_id
from driver.state.journal.start_fate import next_start
from driver.state.recovery.quarantine import (
    salvage_entries,
)

HEADERS = ("CLAIM", "UID", "STATE", "DEVICES", "CDI SPEC", "NEXT START")


HELP = "show the plugin's prepare journal; quarantine a corrupt one"


def add_parser(subcommands: Any) -> None:
    parser = add_command(subcommands, "journal", __doc__, HELP)
    actions = parser.add_subparsers(dest="journal_action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="prepared claims, devices, MIG records, corruption")
    add_common_arguments(show)
    add_output_argument(show)
    show.set_defaults(run=run_show)
    journal_quarantine.add_parser(actions)


# -- show ------------------------------------------------------------------------------


def read_journal(state_dir: Path, cdi_root: Path | None, driver: str) -> dict[str, Any]:
    """The journal as `show -o json` prints it."""
    checkpoint = Checkpoint(state_dir)
    report: dict[str, Any] = {
        "path": str(checkpoint.path),
        "logPath": str(checkpoint.log_path),
        "status": "ok",
        "problem": None,
        "problemPath": None,
        "verified": True,
        "schemaVersion": None,
        "pendingLogRecords": 0,
        "tornLogBytes": 0,
        "entries": [],
        "corruptCopies": [str(p) for p in checkpoint.corrupt_copies()],
    }
    entries: dict[str, ClaimEntry]
    try:
        view = checkpoint.inspect()
        entries = dict(view.entries)
        report.update(
            schemaVersion=view.schema_version or None,
            pendingLogRecords=view.log_records,
            tornLogBytes=view.torn_bytes,
        )
        if not os.path.lexists(checkpoint.path):
            report["status"] = "absent"
    except CheckpointCorruptError as err:
        report.update(
            status="corrupt", problem=err.reason, problemPath=str(err.path), verified=False
        )
        entries = salvage_entries(checkpoint.path)
    except DriverError as err:
        report.update(status="unreadable", problem=str(err), verified=False)
        entries = {}
    specs = cdi_specs(cdi_root, driver) if cdi_root is not None else None
    report["cdiRoot"] = str(cdi_root) if specs is not None else None
    boot = boot_id()
    for uid, entry in sorted(entries.items(), key=lambda i: (i[1].namespace, i[1].name, i[0])):
        report["entries"].append(_entry_json(uid, entry, specs, boot))
    return report


def _entry_json(uid: str, entry: ClaimEntry, specs: CdiSpecs | None, boot: str) -> dict[str, Any]:
    if entry.state is ClaimState.PREPARE_STARTED:
        verdict = (
            "half-done prepare: rolled back (specs and MIG devices it created removed) at "
            "the plugin's next start or the claim's next prepare"
        )
    elif entry.cdi_spec is None:
        verdict = "prepared (entry predates stored CDI specs: a lost spec is redone by prepare)"
    else:
        verdict = "prepared"
    present = None if specs is None else specs.claim_spec_exists(uid)
    return {
        "uid": uid,
        "namespace": entry.namespace,
        "name": entry.name,
        "state": entry.state.value,
        "verdict": verdict,
        "nextStart": next_start(entry, present, boot),
        "cdiSpecStored": entry.cdi_spec is not None,
        "cdiSpecPresent": present,
        "devices": [d.to_json() for d in entry.devices],
    }


@std_streams
def run_show(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    state_dir = state_dir_of(args)
    if not state_dir.is_dir():
        print(f"gpu-dra journal show: no plugin data directory {state_dir}", file=err)
        return 1
    report = read_journal(state_dir, cdi_root_of(args), args.driver_name)
    print_report(report, args.output, out, render_table)
    if report["status"] in ("corrupt", "unreadable"):
        print(f"gpu-dra journal show: {report['path']} is {report['status']}", file=err)
        return 1
    return 0


def _device_text(device: dict[str, Any]) -> str:
    mig = device.get("mig")
    if mig is None:
        return str(device["device"])
    start, size = mig["placement"]
    kind = "created" if mig["owned"] else "static"
    ids = f" GI {mig['giId']}/CI {mig['ciId']}" if mig["giId"] is not None else ""
    return f"{device['device']} (MIG {kind}{ids} at {start}+{size})"


def render_table(report: dict[str, Any]) -> str:
    rows = []
    for entry in report["entries"]:
        present = entry["cdiSpecPresent"]
        rows.append(
            (
                f"{entry['namespace']}/{entry['name']}",
                entry["uid"],
                entry["state"],
                ", ".join(_device_text(d) for d in entry["devices"]) or "-",
                "?" if present is None else ("present" if present else "MISSING"),
                entry["nextStart"],
            )
        )
    lines = [format_table(HEADERS, rows)] if rows else []
    status = report["status"]
    if status == "ok":
        lines.append(f"journal {report['path']}: valid, {len(rows)} claim(s)")
        lines.append(_log_text(report))
    elif status == "absent":
        lines.append(f"journal {report['path']}: absent (no claim prepared)")
    else:
        shown = f"; {len(rows)} entr(ies) shown as stored, UNVERIFIED" if rows else ""
        where = report["problemPath"] or report["path"]
        lines.append(f"journal {where}: {status.upper()}: {report['problem']}{shown}")
        lines.append(
            "prepare is refused until it is repaired or moved aside: gpu-dra journal quarantine"
        )
    if report["cdiRoot"] is None:
        lines.append("CDI specs not checked (no CDI root; give --cdi-root)")
    for copy in report["corruptCopies"]:
        lines.append(f"moved aside earlier: {copy}")
    return "\n".join(lines) + "\n"


def _log_text(report: dict[str, Any]) -> str:
    if report["schemaVersion"] == 1:
        return f"log {report['logPath']}: none pending (compacted into the snapshot)"
    text = (
        f"log {report['logPath']}: {report['pendingLogRecords']} record(s) pending "
        "(replayed over the snapshot; folded into it at the plugin's next clean stop or start)"
    )
    if report["tornLogBytes"]:
        text += f"; a torn last record of {report['tornLogBytes']} bytes is ignored"
    return text
