"""`gpu-dra validate FILE|DIR|- ...`: check GpuConfigs and claims in YAML files before
applying them.

Each file may hold several YAML documents: bare GpuConfig documents, ResourceClaims,
ResourceClaimTemplates and DeviceClasses (any resource.k8s.io version), and lists of
them (`kind: List` or any `*List` kind, as `kubectl get -o yaml` prints). Other
Kubernetes objects (Pods, Namespaces, ...) are skipped; a document that is neither a
Kubernetes object nor a GpuConfig (no apiVersion or kind: a Helm values file) is a
problem. A directory means its *.yaml, *.yml and *.json files (not recursive); `-`
reads standard input. The same decoding, defaults and static rules as the webhook and
the plugin apply to each GpuConfig.

A claim is also checked as a whole (the files are read first, so a DeviceClass in one
file is known in all): each request's deviceClassName must be a class of
--driver-name (the chart's `<driver>`, `mig.<driver>`, `partition.<driver>`, those
given with --device-class, a DeviceClass in the files selecting the driver) or a
DeviceClass of another driver in the files (any other name close to one of the
driver's is reported; one that is not is another driver's class the tool cannot know:
a note names it, not checked); each name in a config's `requests` must
be a request or `<request>/<sub-request>` of the claim; and the config prepare applies
to a request must not be SpacePartitioning on `mig.<driver>` or `partition.<driver>`
(a partition is never split). A claim that asks for a class of the driver is the
driver's, GpuConfig or not.

With `--slices FILE` (ResourceSlices, e.g. `kubectl get resourceslices -o yaml` or
`gpu-dra inventory -o yaml`), a claim request whose `capacity.requests` no single
published device of --driver-name can give is reported too (the scheduler would leave
it pending), and so is a SpacePartitioning config that every published device refuses
at prepare (`partitionCount` above every `maxPartitions`, every whole GPU shared by
capacity), and a non-Default time-slice interval where every published device is a MIG
device (a partition, or a GPU in MIG mode: `migProfile`). A request of one of the
chart's classes is checked against the devices that class selects (whole GPUs, MIG
partitions or `--gpu-partitions` partitions).

With `--explain` (and `--slices FILE|-`), each claim request's CEL selectors are
evaluated on every published device instead, then its capacity requests and, when
ResourceClaims are given with the slices (`kubectl get resourceslices,resourceclaims
-A -o yaml`), what their allocations leave of each device (driver/cli/validate/explain.py): a
summary per request and selector, `--devices` adds one line per device; exit code 1
when a request has fewer matching devices than it needs.

Every problem is printed to stderr on one line:

    FILE: <kind>/<name>: <field path>: <message>
    FILE: invalid YAML: line L, column C: <message>

A document that asks for SpacePartitioning gets one note on stdout (it does not fail
validation): only a node that runs MPS daemons limits it, per CUDA process and for
processes that use MPS; elsewhere the partition count is only passed to the container
as env. On success one summary line goes to stdout, also when
the files hold nothing to check. Exit code 1 if any file or directory is missing,
unreadable or empty, any document or config is invalid, or GpuConfigs or claims were
found but none is for --driver-name (neither a GpuConfig, nor a claim asking for a
class of the driver or configuring it, nor - with --slices publishing devices of that
driver - a claim with capacity requests checked against them); else 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from driver.cli.arguments import add_command
from driver.cli.output import std_streams
from driver.cli.validate.capacity import capacity_problems, requests_capacity
from driver.cli.validate.claim_rules import (
    DeviceClasses,
    claim_problems,
    class_notes,
    is_for_driver,
)
from driver.cli.validate.explain import run_explain
from driver.cli.validate.slice_devices import OfferedDevice, devices_of_slices
from driver.config import (
    LoadError,
    Strategy,
    gpu_config_errors,
    is_checked_document,
    load_yaml_documents,
)
from driver.config import validate_claim_document as check_document
from driver.config.config_error import FieldError
from driver.config.document_checks import CONFIG_LIST_PATHS, config_list_of
from driver.config.loader import join_path
from driver.observability.logs import escaped

DEFAULT_DRIVER_NAME = "gpu.example.com"
DIRECTORY_SUFFIXES = (".yaml", ".yml", ".json")
PROG = "gpu-dra validate"
SPACE_PARTITIONING_NOTE = (
    "note: SpacePartitioning is limited only on nodes that run MPS (devices with the "
    "attribute mpsIsolation: cooperative): each CUDA process, not the claim, gets "
    "1/partitionCount of the GPU's memory and SMs, and a process that bypasses MPS is not "
    "limited; elsewhere it is advisory: the container gets GPU_DEVICE_<id>_PARTITION_COUNT"
)


HELP = (
    "validate GpuConfigs and claims in YAML files (GpuConfig, ResourceClaim, "
    "ResourceClaimTemplate, DeviceClass)"
)


def add_parser(subcommands: Any) -> None:
    parser = add_command(subcommands, "validate", __doc__, HELP)
    parser.add_argument(
        "files", nargs="+", metavar="FILE", help="YAML/JSON file, directory, or - for stdin"
    )
    parser.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER_NAME,
        help="DRA driver name whose configs and device classes are checked (default: %(default)s)",
    )
    parser.add_argument(
        "--device-class",
        action="append",
        default=[],
        metavar="NAME",
        help="a DeviceClass of --driver-name besides the chart's <driver>, mig.<driver> and "
        "partition.<driver> (e.g. one renamed in the chart's deviceClasses); repeatable",
    )
    parser.add_argument(
        "--slices",
        action="append",
        metavar="FILE",
        help="ResourceSlices (YAML/JSON, Lists too) to check capacity requests and "
        "SpacePartitioning configs against; repeatable (with --explain, - reads stdin)",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="say, for each claim request, which CEL selector (of its DeviceClass or its "
        "own), capacity request or allocation (ResourceClaims given with --slices) excludes "
        "the devices in --slices: a summary per selector",
    )
    parser.add_argument(
        "--devices",
        action="store_true",
        help="with --explain: one line per request and device too (default: the summary)",
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


@dataclass
class Result:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # stdout; never fail validation
    checked: int = 0  # GpuConfig and claim documents
    # Of those: GpuConfigs, claims and DeviceClasses for the driver (is_for_driver), or
    # (--slices) claims with capacity requests checked against the driver's devices.
    ours: int = 0
    drivers: set[str] = field(default_factory=set)  # opaque config drivers seen
    files: int = 0

    def report(self, filename: str, label: str, errors: Iterable[FieldError]) -> None:
        for error in errors:
            self.problems.append(f"{filename}: {label}: {error.path or '<root>'}: {error.message}")


@dataclass(frozen=True)
class Checks:
    """What every document is checked against."""

    driver: str
    classes: DeviceClasses
    devices: list[OfferedDevice] | None  # from --slices


def _load_devices(names: list[str], driver_name: str, result: Result) -> list[OfferedDevice]:
    devices: list[OfferedDevice] = []
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


def _not_an_object(doc: object) -> str | None:
    """Why a skipped document is no Kubernetes object, or None."""
    if not isinstance(doc, Mapping):
        return None
    missing = [key for key in ("apiVersion", "kind") if not isinstance(doc.get(key), str)]
    if not missing:
        return None
    return f"not a Kubernetes object or GpuConfig (no {' and '.join(missing)})"


def _check_document(result: Result, filename: str, doc: object, label: str, checks: Checks) -> None:
    if not is_checked_document(doc):
        why = _not_an_object(doc)
        if why is not None:
            result.report(filename, label, [FieldError("", why)])
        return
    result.checked += 1
    drivers = _opaque_drivers(doc)
    result.drivers |= drivers
    capacity_checked = bool(checks.devices) and requests_capacity(doc)
    if (
        _is_gpu_config(doc)
        or checks.driver in drivers
        or capacity_checked
        or is_for_driver(doc, checks.classes)
    ):
        result.ours += 1
    result.report(filename, label, check_document(doc, checks.driver))
    result.report(filename, label, claim_problems(doc, checks.classes, checks.devices))
    for note in class_notes(doc, checks.classes):
        result.notes.append(f"{filename}: {label}: {note.path}: note: {note.message}")
    note_path = _space_partitioning(doc, checks.driver)
    if note_path is not None:
        result.notes.append(f"{filename}: {label}: {note_path}: {SPACE_PARTITIONING_NOTE}")
    if checks.devices is not None:
        result.report(filename, label, capacity_problems(doc, checks.devices, checks.classes))


def _inputs(names: list[str], result: Result) -> Iterator[tuple[str, bool]]:
    """The files to read, each with whether it was found in a directory: each name, a
    directory's *.yaml/*.yml/*.json files."""
    for name in names:
        if name == "-":
            yield name, False
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
            yield from ((str(p), True) for p in found)
        elif not path.exists() and not path.is_symlink():
            result.problems.append(f"{name}: no such file or directory")
        else:
            yield name, False


def _no_manifests(docs: list[Any]) -> bool:
    """Are the file's documents all mappings without apiVersion and kind (a Helm values
    file, a kustomize or tool config beside the manifests)?"""
    return all(
        isinstance(doc, Mapping) and "apiVersion" not in doc and "kind" not in doc for doc in docs
    )


def _read(names: list[str], stdin: TextIO, result: Result) -> Iterator[tuple[str, list[Any]]]:
    """(file name, its documents) of each input that reads and parses."""
    for filename, in_directory in _inputs(names, result):
        try:
            if filename == "-":
                text: str | bytes = stdin.read()
            else:
                with open(filename, "rb") as handle:
                    text = handle.read()
        except OSError as error:
            result.problems.append(f"{filename}: cannot read: {error.strerror or error}")
            continue
        result.files += 1
        try:
            docs = load_yaml_documents(text)
        except LoadError as err:
            result.problems.append(f"{filename}: {err}")
            continue
        if not docs:
            result.problems.append(f"{filename}: empty: no YAML documents")
            continue
        if in_directory and _no_manifests(docs):
            result.files -= 1
            result.notes.append(
                f"{filename}: skipped: no document has apiVersion or kind (a Helm values "
                "file?); name the file to check it anyway"
            )
            continue
        yield filename, docs


def _summary(result: Result, driver_name: str) -> tuple[int, str]:
    """Exit code and the last line (stderr on failure, stdout on success)."""
    if result.problems:
        return 1, f"{PROG}: {len(result.problems)} problem(s) found"
    if result.checked == 0:
        return 0, (
            f"OK: nothing to check for driver {driver_name}: no GpuConfig or claim document "
            f"in {result.files} file(s)"
        )
    if result.ours == 0:
        others = ", ".join(sorted(result.drivers)) or "none"
        return 1, (
            f"{PROG}: --driver-name {driver_name} matches no document: no GpuConfig, no "
            f"claim asking for its classes and no opaque config for it (opaque configs "
            f"found for: {others})"
        )
    return 0, (
        f"OK: {result.checked} GpuConfig/claim document(s) in {result.files} file(s) valid "
        f"for driver {driver_name}"
    )


@std_streams
def run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    if args.explain:
        return run_explain(args, stdin, out, err)
    if args.devices:
        print(f"{PROG}: --devices needs --explain", file=err)
        return 2
    result = Result()
    devices = _load_devices(list(args.slices), args.driver_name, result) if args.slices else None
    files = list(_read(list(args.files), stdin, result))
    documents = [doc for _, docs in files for doc, _ in _documents(docs)]
    classes = DeviceClasses.of(args.driver_name, args.device_class, documents)
    checks = Checks(args.driver_name, classes, devices)
    for filename, docs in files:
        for doc, label in _documents(docs):
            if _is_list(doc):
                result.problems.append(f"{filename}: {label}: items: must be a list")
            else:
                _check_document(result, filename, doc, label, checks)
    for line in result.notes:  # they quote the files' strings: escaped for the terminal
        print(escaped(line), file=out)
    for line in result.problems:
        print(escaped(line), file=err)
    code, summary = _summary(result, args.driver_name)
    print(summary, file=out if code == 0 else err)
    return code
