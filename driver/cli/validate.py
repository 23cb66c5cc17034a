"""`gpu-dra validate FILE...`: check GpuConfigs in YAML files before applying them.

Each file may hold several YAML documents: bare GpuConfig documents, ResourceClaims,
ResourceClaimTemplates and DeviceClasses (any resource.k8s.io version). Other
documents (Pods, Namespaces, ...) are skipped. The same decoding, defaults and
static rules as the webhook and the plugin apply. Every problem is printed as

    FILE: <kind>/<name>: <field path>: <message>

and the exit code is 1 if any file is unreadable or any config is invalid, else 0.
`-` reads standard input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from driver.config import LoadError, is_checked_document, load_yaml_documents
from driver.config import validate_claim_document as check_document

DEFAULT_DRIVER_NAME = "gpu.example.com"


def add_parser(subcommands: Any) -> None:
    parser: argparse.ArgumentParser = subcommands.add_parser(
        "validate",
        help="validate GpuConfigs in YAML files (GpuConfig, ResourceClaim, ResourceClaimTemplate)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML file, or - for stdin")
    parser.add_argument(
        "--driver-name",
        default=DEFAULT_DRIVER_NAME,
        help="DRA driver name whose opaque configs are checked (default: %(default)s)",
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


def validate_text(text: str | bytes, filename: str, driver_name: str) -> tuple[list[str], int]:
    """Problems in one file as printable lines, and how many documents were checked."""
    try:
        docs = load_yaml_documents(text)
    except LoadError as err:
        return [f"{filename}: {err}"], 0
    lines: list[str] = []
    checked = 0
    for number, doc in enumerate(docs, start=1):
        if not is_checked_document(doc):
            continue
        checked += 1
        label = _label(doc, number)
        for error in check_document(doc, driver_name):
            lines.append(f"{filename}: {label}: {error.path or '<root>'}: {error.message}")
    return lines, checked


def run(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    failed = False
    for filename in args.files:
        try:
            if filename == "-":
                text: str | bytes = stdin.read()
            else:
                with open(filename, "rb") as handle:
                    text = handle.read()
        except OSError as err:
            print(f"{filename}: cannot read: {err.strerror or err}", file=out)
            failed = True
            continue
        lines, checked = validate_text(text, filename, args.driver_name)
        for line in lines:
            print(line, file=out)
        if lines:
            failed = True
        elif checked == 0:
            print(f"{filename}: note: no GpuConfig or claim documents found", file=sys.stderr)
    return 1 if failed else 0
