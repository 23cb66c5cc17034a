"""`gpu-dra validate FILE|DIR|- ...`: check GpuConfigs in YAML files before applying them.

Each file may hold several YAML documents: bare GpuConfig documents, ResourceClaims,
ResourceClaimTemplates and DeviceClasses (any resource.k8s.io version), and lists of
them (`kind: List` or any `*List` kind, as `kubectl get -o yaml` prints). Other
documents (Pods, Namespaces, ...) are skipped. A directory means its *.yaml, *.yml
and *.json files (not recursive); `-` reads standard input. The same decoding,
defaults and static rules as the webhook and the plugin apply.

With `--slices FILE` (ResourceSlices, e.g. `kubectl get resourceslices -o yaml` or
`gpu-dra inventory -o yaml`), a claim request whose `capacity.requests` no single
published device of --driver-name can give is reported too: the scheduler would leave
it pending.

Every problem is printed to stderr as

    FILE: <kind>/<name>: <field path>: <message>

A document that asks for SpacePartitioning gets one note on stdout (it does not fail
validation): on real GPUs the partition count is only passed to the container as env,
no MPS daemon splits the GPU. On success one summary line goes to stdout. Exit code 1
if any file or directory is missing, unreadable or empty, any config is invalid, no
GpuConfig or claim document was found at all, or no document is for --driver-name
(neither a GpuConfig, nor an opaque config of that driver, nor - with --slices
publishing devices of that driver - a claim with capacity requests checked against
them); else 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from driver.cli.capacity import (
    CapacityDevice,
    capacity_problems,
    devices_of_slices,
    requests_capacity,
)
from driver.config import (
    LoadError,
    Strategy,
    gpu_config_errors,
    is_checked_document,
    load_yaml_documents,
)
from driver.config import validate_claim_document as check_document
from driver.config.documents import CONFIG_LIST_PATHS, config_list_of
from driver.config.loader import join_path

DEFAULT_DRIVER_NAME = "gpu.example.com"
DIRECTORY_SUFFIXES = (".yaml", ".yml", ".json")
PROG = "gpu-dra validate"
SPACE_PARTITIONING_NOTE = (
    "note: SpacePartitioning is advisory on real GPUs: the container gets the partition "
    "count as env (GPU_DEVICE_<id>_PARTITION_COUNT), no MPS daemon splits the GPU"
)


def add_parser(subcommands: Any) -> None:
    parser: argparse.ArgumentParser = subcommands.add_parser(
        "validate",
        help="validate GpuConfigs in YAML files (GpuConfig, ResourceClaim, ResourceClaimTemplate)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "files", nargs="+", metavar="FILE", help="YAML/JSON file, directory, or - for stdin"
    )
    parser.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER_NAME,
        help="DRA driver name whose opaque configs are checked (default: %(default)s)",
    )
    parser.add_argument(
        "--slices",
        action="append",
        metavar="FILE",
        help="ResourceSlices (YAML/JSON, Lists too) to check capacity requests against; repeatable",
    )
    parser.set_defaults(run=run)


def _label(doc: object, number: int) -> str:
    if not isinstance(doc, Mapping):
        return f"document #{number}"
    kind = doc.get("kind")
    metadata = doc.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        name = f"#{number}"
    return f"{kind if isinstance(kind, str) and kind else '<no kind>'}/{name}"


def _is_list(doc: object) -> bool:
    if not isinstance(doc, Mapping):
        return False
    kind = doc.get("kind")
    return isinstance(kind, str) and kind.endswith("List") and "items" in doc


def _documents(docs: list[Any]) -> Iterator[tuple[object, str]]:
    """Each document with its label; the items of a List stand for the List."""
    for number, doc in enumerate(docs, start=1):
        if _is_list(doc):
            items = doc.get("items")
            if not isinstance(items, list):
                yield doc, _label(doc, number)  # reported below as malformed
                continue
            for index, item in enumerate(items):
                yield item, f"{_label(doc, number)}: items[{index}]: {_label(item, index + 1)}"
        else:
            yield doc, _label(doc, number)


def _opaque_drivers(doc: object) -> set[str]:
    if not isinstance(doc, Mapping) or doc.get("kind") not in CONFIG_LIST_PATHS:
        return set()
    configs = config_list_of(doc, str(doc.get("kind")))
    drivers: set[str] = set()
    for entry in configs if isinstance(configs, list) else []:
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        driver = opaque.get("driver") if isinstance(opaque, Mapping) else None
        if isinstance(driver, str):
            drivers.add(driver)
    return drivers


def _is_gpu_config(doc: object) -> bool:
    return isinstance(doc, Mapping) and doc.get("kind") not in CONFIG_LIST_PATHS


def _space_partitioning(doc: object, driver_name: str) -> str | None:
    """The field path of the document's first (valid) GpuConfig for `driver_name`
    that asks for SpacePartitioning, or None."""
    if _is_gpu_config(doc):
        config, _ = gpu_config_errors(doc, "")
        spaced = config is not None and config.strategy == Strategy.SPACE_PARTITIONING
        return "sharing.strategy" if spaced else None
    if not isinstance(doc, Mapping):
        return None
    kind = str(doc.get("kind"))
    configs = config_list_of(doc, kind)
    for index, entry in enumerate(configs if isinstance(configs, list) else []):
        opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver_name:
            continue
        config, _ = gpu_config_errors(opaque.get("parameters"), "")
        if config is not None and config.strategy == Strategy.SPACE_PARTITIONING:
            path = join_path(".".join(CONFIG_LIST_PATHS[kind]), index)
            return f"{path}.opaque.parameters.sharing.strategy"
    return None


class Result:
    def __init__(self) -> None:
        self.problems: list[str] = []
        self.notes: list[str] = []  # stdout; never fail validation
        self.checked = 0  # GpuConfig and claim documents
        # Of those: GpuConfigs, with an opaque config for the driver, or (--slices) with
        # capacity requests checked against the driver's devices.
        self.ours = 0
        self.drivers: set[str] = set()  # opaque config drivers seen
        self.files = 0
        self.devices: list[CapacityDevice] | None = None  # from --slices


def _load_devices(names: list[str], driver_name: str, result: Result) -> list[CapacityDevice]:
    devices: list[CapacityDevice] = []
    for name in names:
        try:
            with open(name, "rb") as handle:
                docs = load_yaml_documents(handle.read())
        except OSError as err:
            result.problems.append(f"--slices {name}: cannot read: {err.strerror or err}")
            continue
        except LoadError as err:
            result.problems.append(f"--slices {name}: {err}")
            continue
        devices += devices_of_slices((doc for doc, _ in _documents(docs)), driver_name)
    return devices


def validate_text(text: str | bytes, filename: str, driver_name: str) -> tuple[list[str], int]:
    """Problems in one file as printable lines, and how many documents were checked."""
    result = Result()
    _validate_into(result, text, filename, driver_name)
    return result.problems, result.checked


def _validate_into(result: Result, text: str | bytes, filename: str, driver_name: str) -> None:
    result.files += 1
    try:
        docs = load_yaml_documents(text)
    except LoadError as err:
        result.problems.append(f"{filename}: {err}")
        return
    if not docs:
        result.problems.append(f"{filename}: empty: no YAML documents")
        return
    for doc, label in _documents(docs):
        if _is_list(doc):
            result.problems.append(f"{filename}: {label}: items: must be a list")
            continue
        if not is_checked_document(doc):
            continue
        result.checked += 1
        drivers = _opaque_drivers(doc)
        result.drivers |= drivers
        capacity_checked = bool(result.devices) and requests_capacity(doc)
        if _is_gpu_config(doc) or driver_name in drivers or capacity_checked:
            result.ours += 1
        for error in check_document(doc, driver_name):
            result.problems.append(
                f"{filename}: {label}: {error.path or '<root>'}: {error.message}"
            )
        note_path = _space_partitioning(doc, driver_name)
        if note_path is not None:
            result.notes.append(f"{filename}: {label}: {note_path}: {SPACE_PARTITIONING_NOTE}")
        if result.devices is not None:
            for problem in capacity_problems(doc, result.devices):
                result.problems.append(f"{filename}: {label}: {problem.path}: {problem.message}")


def _inputs(names: list[str], result: Result) -> Iterator[str]:
    """The files to read: each name, a directory's *.yaml/*.yml/*.json files."""
    for name in names:
        if name == "-":
            yield name
            continue
        path = Path(name)
        if path.is_dir():
            try:
                found = sorted(
                    p for p in path.iterdir() if p.suffix in DIRECTORY_SUFFIXES and not p.is_dir()
                )
            except OSError as err:
                result.problems.append(f"{name}: cannot list directory: {err.strerror or err}")
                continue
            if not found:
                result.problems.append(
                    f"{name}: directory has no {', '.join('*' + s for s in DIRECTORY_SUFFIXES)}"
                    " files"
                )
            yield from (str(p) for p in found)
        elif not path.exists() and not path.is_symlink():
            result.problems.append(f"{name}: no such file or directory")
        else:
            yield name


def run(
    args: argparse.Namespace,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    result = Result()
    if args.slices:
        result.devices = _load_devices(list(args.slices), args.driver_name, result)
    for filename in _inputs(list(args.files), result):
        try:
            if filename == "-":
                text: str | bytes = stdin.read()
            else:
                with open(filename, "rb") as handle:
                    text = handle.read()
        except OSError as error:
            result.problems.append(f"{filename}: cannot read: {error.strerror or error}")
            continue
        _validate_into(result, text, filename, args.driver_name)
    for line in result.notes:
        print(line, file=out)
    for line in result.problems:
        print(line, file=err)
    if result.problems:
        print(f"{PROG}: {len(result.problems)} problem(s) found", file=err)
        return 1
    if result.checked == 0:
        print(
            f"{PROG}: no GpuConfig or claim documents found in {result.files} file(s) "
            "(expected GpuConfig, ResourceClaim, ResourceClaimTemplate or DeviceClass)",
            file=err,
        )
        return 1
    if result.ours == 0:
        others = ", ".join(sorted(result.drivers)) or "none"
        print(
            f"{PROG}: --driver-name {args.driver_name} matches no document: no GpuConfig "
            f"and no opaque config for it (opaque configs found for: {others})",
            file=err,
        )
        return 1
    print(
        f"OK: {result.checked} GpuConfig/claim document(s) in {result.files} file(s) valid "
        f"for driver {args.driver_name}",
        file=out,
    )
    return 0
