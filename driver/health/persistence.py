"""The health store's file (`<data dir>/health.json`): JSON, written atomically.

    {"version": 1,
     "gpus": {"GPU-...": {"key": "gpu.example.com/xid", "value": "79",
                          "reason": "Xid 79", "since": "2026-...Z"}},
     "instances": {"GPU-...": [{"start": 3, "size": 1, "gpuInstanceId": 9,
                                "computeInstanceId": 0, "key": "gpu.example.com/xid",
                                "value": "94", "reason": "Xid 94", "since": "..."}]}}

`instances` is written only when there is one (a file without it reads as before).
A record of a kind this release does not know (a newer release's) is kept as it is:
it fails its GPU (or instance) and is written back on every rewrite. A file whose
`version` is above SCHEMA_VERSION (a newer release's, after a downgrade) is never
interpreted: `load_records` raises `HealthStoreNewerError`. A file that cannot be
parsed, or a symlink or anything but a regular file at the path (never followed,
never opened blocking), is corrupt: `load_records` raises `HealthStoreCorruptError`.
Either way the file is left where it is (the store then keeps every GPU failed until
an operator repairs it or the newer release runs again).
"""

from __future__ import annotations

import errno
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.fileio import UnsafeFileError, atomic_write, read_file_nofollow
from driver.health.failures import KIND_RANK, GpuFailure, Placement

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


@dataclass
class HealthRecords:
    """Whole-GPU failures by GPU UUID; GPU-instance failures by GPU UUID and placement."""

    gpus: dict[str, GpuFailure] = field(default_factory=dict)
    instances: dict[str, dict[Placement, GpuFailure]] = field(default_factory=dict)


class HealthStoreCorruptError(ValueError):
    """The file exists but cannot be trusted: which GPUs failed is unknown."""

    state = "is corrupt"
    remedy = "an operator restores the file or moves it aside and restarts the plugin"

    def __init__(self, path: Path, reason: object) -> None:
        super().__init__(f"health store {path} {self.state} ({reason})")


class HealthStoreNewerError(HealthStoreCorruptError):
    """The file is a newer release's: kept untouched, every GPU kept failed."""

    state = "was written by a newer release"
    remedy = (
        "the newer release runs again (or an operator who accepts losing its records "
        "moves the file aside and restarts the plugin)"
    )


class NewerSchemaError(ValueError):
    """The file's `version` is one a newer release writes: this release cannot tell
    what it would drop by reading it."""


def load_records(path: Path) -> HealthRecords:
    """The records in `path`; empty when there is no file. Raises
    HealthStoreCorruptError for a file that cannot be parsed or is no regular file
    (left untouched), OSError when it cannot be read at all."""
    try:
        raw = read_file_nofollow(path)
    except FileNotFoundError:
        return HealthRecords()
    except UnsafeFileError as err:  # a symlink is never followed, a FIFO never opened
        code = errno.errorcode.get(err.errno or 0, str(err.errno))
        raise HealthStoreCorruptError(path, f"{err.strerror} ({code})") from err
    try:
        return parse_records(raw)
    except NewerSchemaError as err:
        raise HealthStoreNewerError(path, err) from err
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise HealthStoreCorruptError(path, f"{type(err).__name__}: {err}") from err


def parse_records(raw: bytes) -> HealthRecords:
    """Parse the file's bytes; raises NewerSchemaError for a newer release's file,
    ValueError, KeyError, TypeError on garbage."""
    doc = json.loads(raw)
    version = doc.get("version", 1)  # a file repaired by hand may leave it out
    if type(version) is not int or version < 1:
        raise ValueError(f"version is not a schema version: {version!r}")
    if version > SCHEMA_VERSION:
        raise NewerSchemaError(
            f"schema version {version}; this release reads up to {SCHEMA_VERSION}"
        )
    gpus = doc["gpus"]
    if not isinstance(gpus, dict):
        raise TypeError("gpus is not an object")
    records = HealthRecords({uuid: parse_failure(rec, uuid) for uuid, rec in gpus.items()})
    instances = doc.get("instances", {})
    if not isinstance(instances, dict):
        raise TypeError("instances is not an object")
    for uuid, listed in instances.items():
        if not isinstance(listed, list):
            raise TypeError(f"instances of {uuid} is not a list")
        for rec in listed:
            failure = parse_failure(rec, uuid)
            if failure.placement is None:
                raise ValueError(f"instance record of {uuid} has no placement")
            records.instances.setdefault(uuid, {})[failure.placement] = failure
    return records


def parse_failure(rec: Any, uuid: str) -> GpuFailure:
    """One record, of any kind (one this release does not know is kept as it is).
    Raises on garbage."""
    key = str(rec["key"])
    if key.rsplit("/", 1)[-1] not in KIND_RANK:
        log.warning("health store: keeping failure %r of a newer release for %s", key, uuid)
    value = rec.get("value")
    placement: Placement | None = None
    if "start" in rec or "size" in rec:
        start, size = rec["start"], rec["size"]
        if type(start) is not int or type(size) is not int:  # a bool is no int here
            raise TypeError(f"bad placement {start!r}+{size!r} for {uuid}")
        if start < 0 or size <= 0:
            raise ValueError(f"bad placement {start}+{size} for {uuid}")
        placement = (start, size)
    return GpuFailure(
        key=key,
        value=None if value is None else str(value),
        reason=str(rec.get("reason", "")),
        since=str(rec.get("since", "")),
        placement=placement,
        gpu_instance_id=_optional_id(rec.get("gpuInstanceId")),
        compute_instance_id=_optional_id(rec.get("computeInstanceId")),
    )


def _optional_id(value: object) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"bad instance ID {value!r}")
    return value


def _failure_record(failure: GpuFailure) -> dict[str, Any]:
    return {
        "key": failure.key,
        "value": failure.value,
        "reason": failure.reason,
        "since": failure.since,
    }


def encode_records(records: HealthRecords) -> bytes:
    doc: dict[str, Any] = {
        "version": SCHEMA_VERSION,
        "gpus": {uuid: _failure_record(f) for uuid, f in sorted(records.gpus.items())},
    }
    if records.instances:
        doc["instances"] = {
            uuid: [
                {
                    "start": start,
                    "size": size,
                    "gpuInstanceId": f.gpu_instance_id,
                    "computeInstanceId": f.compute_instance_id,
                    **_failure_record(f),
                }
                for (start, size), f in sorted(by_placement.items())
            ]
            for uuid, by_placement in sorted(records.instances.items())
        }
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


def write_records(path: Path, records: HealthRecords) -> None:
    """Atomically replace the file (0600, its directory 0700 if created). Raises OSError."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(path, encode_records(records))
