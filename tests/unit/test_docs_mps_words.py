"""What the docs, the demo and the CHANGELOG say MPS limits are (issue 44): per client
process, not per claim; cooperative (a process that bypasses MPS is not limited); a
fault in one process reaches the other processes of its claim's server; the servers
of different claims are time-sliced; 48 clients per server; memory overcommitted by
the servers' own contexts. Never "enforced", and never the former `mps: true`
attribute (devices publish `mpsIsolation: "cooperative"`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_docs_guides import anchor_problems

REPO = Path(__file__).resolve().parents[2]
MPS_DOC = REPO / "docs" / "mps.md"
SHARING_DOC = REPO / "docs" / "sharing.md"
README = REPO / "README.md"
DEMO = REPO / "demo"
CHANGELOG = REPO / "CHANGELOG.md"


def unreleased() -> str:
    text = CHANGELOG.read_text()
    return text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]


def texts() -> dict[str, str]:
    """The texts that describe MPS sharing to users, by name."""
    out = {
        "README.md": README.read_text(),
        "docs/mps.md": MPS_DOC.read_text(),
        "docs/sharing.md": SHARING_DOC.read_text(),
        "demo/README.md": (DEMO / "README.md").read_text(),
        "demo/demo.sh": (DEMO / "demo.sh").read_text(),
        "CHANGELOG.md [Unreleased]": unreleased(),
    }
    for path in sorted((DEMO / "mps").iterdir()):
        out[str(path.relative_to(REPO))] = path.read_text()
    return out


def paragraphs(text: str) -> list[str]:
    """Paragraphs and list items, whitespace collapsed."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n|\n(?=\s*- )", text)]


@pytest.mark.parametrize("name", sorted(texts()))
def test_no_text_calls_mps_limits_enforced(name: str) -> None:
    # The CHANGELOG's rename note names the demo's former file, and that only.
    text = texts()[name].replace("`enforced-shares.yaml`", "")
    said = [p for p in paragraphs(text) if "MPS" in p and re.search(r"(?i)\benforc", p) is not None]
    assert not said, said


@pytest.mark.parametrize("name", sorted(texts()))
def test_no_text_shows_the_former_mps_attribute(name: str) -> None:
    text = texts()[name]
    if name.startswith("CHANGELOG"):
        # The rename note names the old attribute and selector once, in Changed.
        (note,) = [p for p in paragraphs(text) if "instead of the bool `mps: true`" in p]
        text = " ".join(text.split()).replace(note, "")
    assert "mps: true" not in text
    assert not re.search(r"\]\.mps\b(?!Isolation)|'mps' in|\"mps\" in", text), name


def test_the_demo_example_is_named_for_what_it_shows() -> None:
    assert (DEMO / "mps" / "cooperative-shares.yaml").is_file()
    assert not (DEMO / "mps" / "enforced-shares.yaml").exists()
    for name, text in texts().items():
        if not name.startswith("CHANGELOG"):
            assert "enforced-shares" not in text, name


def test_the_mps_doc_has_a_table_of_what_holds_and_what_does_not() -> None:
    text = MPS_DOC.read_text()
    assert "## What holds and what does not" in text
    assert "| mode | what holds | what does not |" in text
    assert '`mpsIsolation: "cooperative"`' in text
    # "strict": a whole GPU held in EXCLUSIVE_PROCESS, with what it still does not hold.
    (strict,) = [row for row in text.splitlines() if row.startswith('| `mpsIsolation: "strict"`')]
    assert "EXCLUSIVE_PROCESS" in strict and "before the first MPS client" in strict
    # Strict partitions share one server: its faults, its clients and its /dev/shm.
    assert "every claim's on the GPU" in strict and "all claims' together" in strict
    assert "## Strict: one MPS server, EXCLUSIVE_PROCESS" in text
    assert "## Strict partitions: one server per GPU" in text


@pytest.mark.parametrize(
    "name", ["README.md", "docs/mps.md", "docs/sharing.md", "CHANGELOG.md [Unreleased]"]
)
def test_the_limits_are_described_as_they_are(name: str) -> None:
    text = " ".join(texts()[name].split())
    for words in (
        "per process",  # not per claim
        "CUDA_MPS_PIPE_DIRECTORY",  # a process that bypasses MPS
        "fatal fault in one",  # what a fault in one tenant does to the others
        "time-sliced",  # between servers
        "48 client",  # the client cap
        "overcommit",  # memory: the servers' contexts
    ):
        assert re.search(re.escape(words), text, re.IGNORECASE), f"{name}: {words!r}"


@pytest.mark.parametrize("doc", [README, MPS_DOC, SHARING_DOC, DEMO / "README.md"])
def test_links_to_the_mps_sections_lead_to_headings(doc: Path) -> None:
    assert anchor_problems(doc) == []
