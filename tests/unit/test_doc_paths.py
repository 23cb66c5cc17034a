"""Every file the docs point to exists: repository paths (`driver/...`, `tests/...`,
`hack/...`, ...) named in README.md, docs/*.md and the other READMEs, and the targets of
their relative Markdown links. A module moved or renamed without its docs fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_chart_render import REPO

DOCS = sorted(
    [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        REPO / "deployments" / "helm" / "gpu-dra-driver" / "README.md",
        REPO / "hack" / "kind" / "README.md",
        REPO / "demo" / "README.md",
    ]
)
# Top-level directories of this repository. (`cmd/` and `bench/results/` also name
# paths of other repositories or of a benchmark run's output, so they are left out.)
TOP_LEVEL = ("driver", "tests", "hack", "deployments", "demo", "proto", "docs")
# A path starts a token: not inside a longer path (`~/.cache/gpu-dra-driver/bin`, a URL,
# /proc/driver/nvidia/...), and ends before punctuation.
REPO_PATH = re.compile(r"(?<![\w./~:-])((?:" + "|".join(TOP_LEVEL) + r")/[\w./-]*[\w/])")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def repo_paths(text: str) -> set[str]:
    return {m.group(1).rstrip("/") for m in REPO_PATH.finditer(text)}


def link_targets(text: str) -> set[str]:
    targets = {m.group(1).split("#", 1)[0] for m in MARKDOWN_LINK.finditer(text)}
    return {t for t in targets if t and not re.match(r"^[a-z]+:", t)}


def test_the_patterns_find_what_docs_write() -> None:
    text = (
        "(driver/state/prepare.py, instances.py) see `tests/unit/test_cdi.py`. "
        "~/.cache/gpu-dra-driver/bin /proc/driver/nvidia/capabilities "
        "deployments/helm/gpu-dra-driver/values-mock.yaml [x](docs/mig.md#cdi) [y](https://a/b)"
    )
    assert repo_paths(text) == {
        "driver/state/prepare.py",
        "tests/unit/test_cdi.py",
        "deployments/helm/gpu-dra-driver/values-mock.yaml",
        "docs/mig.md",
    }
    assert link_targets(text) == {"docs/mig.md"}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = sorted(p for p in repo_paths(text) if not (REPO / p).exists())
    assert missing == [], f"{doc.relative_to(REPO)} names files that do not exist"
    broken = sorted(t for t in link_targets(text) if not (doc.parent / t).exists())
    assert broken == [], f"{doc.relative_to(REPO)} links to files that do not exist"
