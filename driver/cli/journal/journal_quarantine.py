"""`gpu-dra journal quarantine`: move a corrupt prepare journal aside
(`checkpoint.json.corrupt-<UTC time>`, `checkpoint.log.corrupt-<UTC time>`, never
deleted) so the plugin can prepare again from an empty journal; `gpu-dra journal
--help` says what it refuses and asks."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from driver.cli.confirm import NotConfirmed, add_yes_argument, confirm
from driver.cli.journal.journal_args import (
    add_common_arguments,
    cdi_root_of,
    cdi_specs,
    state_dir_of,
)
from driver.cli.output import std_streams
from driver.errors import DriverError
from driver.fileio import permission_denied
from driver.state.journal.checkpoint import Checkpoint, CheckpointCorruptError, ClaimEntry
from driver.state.journal.locking import open_lock_file
from driver.state.recovery.quarantine import (
    OwnedMig,
    carried_fate,
    owning_mig,
    pending_quarantine,
    quarantine_checkpoint,
    salvage_entries,
)

# The lock every running plugin instance holds shared for its lifetime
# (`driver.plugin.serving_instance.InstanceLock`).
INSTANCE_LOCK_FILE = "instances.lock"

AFTER_QUARANTINE = """\
On its next start the kubelet plugin:
  - starts from a new journal (empty, or holding what --owned-mig carries over):
    prepare works again;
  - keeps the CDI specs of claims prepared before (reported as orphans at start);
    each is removed by its claim's unprepare, so running pods keep their devices;
  - {mig}
  - cannot protect the devices of those claims against a second local prepare
    until they are unprepared (the scheduler still sees them allocated).
The corrupt files stay next to the journal for inspection.
"""
MIG_FATE = {
    OwnedMig.FOREIGN: """does not know the MIG devices it created for those claims as its own:
    with --mig-strategy auto their GPU is published as static (exactly those MIG
    devices, which a new claim may then get while a pod still uses them), with
    dynamic it refuses to start until they are destroyed; none is destroyed by the
    driver;""",
    OwnedMig.ADOPT: """carries the readable entries listed above into the new journal as
    they were, each with the fate listed (a prepared claim keeps its MIG devices until
    its unprepare destroys them; a half-done prepare whose claim's device is live and
    named by its CDI spec is adopted as prepared, any other rolled back);""",
    OwnedMig.DESTROY: """destroys the MIG devices of the readable entries listed above at its
    next start (each only if the instance under its recorded id still has the
    recorded profile and placement) and removes those claims' CDI specs: pods using
    them lose their devices;""",
}


def add_parser(actions: Any) -> None:
    quarantine = actions.add_parser(
        "quarantine", help="move a corrupt journal aside (timestamped, never deleted)"
    )
    add_common_arguments(quarantine)
    quarantine.add_argument(
        "--owned-mig",
        choices=[m.value for m in OwnedMig],
        help="what becomes of the MIG devices the corrupt journal's readable entries own "
        "(required when there are any): adopt, destroy or leave them foreign",
    )
    add_yes_argument(quarantine)
    quarantine.set_defaults(run=run_quarantine)


class PluginRunning(Exception):
    pass


@contextlib.contextmanager
def no_plugin_running(state_dir: Path) -> Iterator[None]:
    """Hold the plugin instances' lock exclusively (a plugin starting meanwhile waits);
    PluginRunning when a running plugin holds it."""
    path = state_dir / INSTANCE_LOCK_FILE
    fd = open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise PluginRunning(
                    f"a kubelet plugin is running on this node (it holds {path}): stop it "
                    "on this node first (docs/day-2.md), then run this again"
                ) from None
            raise
        yield
    finally:
        os.close(fd)


def _owned_mig_choice(choice: str | None, owning: dict[str, ClaimEntry]) -> OwnedMig:
    if choice is not None:
        return OwnedMig(choice)
    if owning:
        raise ValueError(
            f"the journal's readable entries own the MIG devices of {len(owning)} claim(s): "
            "choose --owned-mig adopt|destroy|foreign (docs/state.md, "
            '"MIG devices after a quarantine")'
        )
    return OwnedMig.FOREIGN


@std_streams
def run_quarantine(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    prog = "gpu-dra journal quarantine"
    state_dir = state_dir_of(args)
    if not state_dir.is_dir():
        print(f"{prog}: no plugin data directory {state_dir}", file=err)
        return 1
    checkpoint = Checkpoint(state_dir)
    try:
        with no_plugin_running(state_dir):
            pending = pending_quarantine(state_dir)
            if pending is not None:  # confirmed by the run it interrupted
                out.write(
                    f"a quarantine of {pending.stamp} (--owned-mig {pending.owned_mig.value})"
                    " was interrupted: finishing it as it was confirmed\n"
                )
                target = quarantine_checkpoint(state_dir)
                print(f"moved aside: {target}", file=out)
                return 0
            if not os.path.lexists(checkpoint.path):
                print(f"no journal at {checkpoint.path}: nothing to move aside", file=out)
                return 0
            try:
                checkpoint.load()
            except CheckpointCorruptError as corrupt:
                reason = corrupt.reason
            else:
                print(f"{prog}: {checkpoint.path} is valid: not moving it", file=err)
                return 1
            owning = owning_mig(salvage_entries(checkpoint.path))
            owned_mig = _owned_mig_choice(args.owned_mig, owning)
            out.write(
                f"{checkpoint.path} is corrupt ({reason}).\n"
                f"It will be renamed to {checkpoint.path.name}.corrupt-<UTC time>, and "
                f"{checkpoint.log_path.name} to {checkpoint.log_path.name}.corrupt-<UTC "
                f"time>, in {state_dir} (kept, never deleted).\n"
            )
            specs = cdi_specs(cdi_root_of(args), args.driver_name)
            for uid, entry in sorted(owning.items()):
                present = None if specs is None else specs.claim_spec_exists(uid)
                out.write(
                    f"  claim {entry.namespace}/{entry.name} ({uid}) owns MIG devices "
                    f"({entry.state.value}): {carried_fate(uid, entry, owned_mig, present)}\n"
                )
            out.write(AFTER_QUARANTINE.format(mig=MIG_FATE[owned_mig]))
            confirm("Move it aside?", yes=args.yes, stdin=stdin, out=out)
            target = quarantine_checkpoint(state_dir, owned_mig=owned_mig)
    except (PluginRunning, NotConfirmed, ValueError, DriverError) as error:
        print(f"{prog}: {error}", file=err)
        return 1
    except PermissionError as error:
        print(f"{prog}: {permission_denied(error.filename)}", file=err)
        return 1
    except OSError as error:
        print(f"{prog}: {error}", file=err)
        return 1
    print(f"moved aside: {target}", file=out)
    return 0
