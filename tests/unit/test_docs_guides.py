"""The operator guides cannot drift from the code. The README links every guide. Every
`gpu-dra ...`, `gpu-kubelet-plugin ...` and `gpu-dra-webhook ...` command they show uses
subcommands and flags that the parsers define. Every flag they name on its own is one
of the driver's flags. Every chart value path exists in values.yaml. Every link to a
section leads to a heading that exists. (tests/unit/test_doc_paths.py checks that the
files they name and link exist.)"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli import build_parser as cli_parser
from driver.plugin.options.flags import build_parser as plugin_parser
from driver.webhook.main import build_parser as webhook_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GUIDES = ("troubleshooting.md", "mig-operations.md", "gpu-failure-runbook.md", "upgrade.md")
VALUES = REPO / "deployments" / "helm" / "gpu-dra-driver" / "values.yaml"

COMMAND = re.compile(r"(?<![\w.-])(gpu-dra-webhook|gpu-kubelet-plugin|gpu-dra)(?![\w-])")
# Shell syntax that ends a command: a pipe, a list, a redirection, a comment.
COMMAND_END = re.compile(r"^(\|\|?|&&|;|<|\)|[#>].*|2>.*|<\(.*)$")
# Arguments that stand for something: <device>, $POD, "$POD", ...
PLACEHOLDER = re.compile(r"^(<.*>|\"?\$.*|\.\.\.|…)$")
STANDALONE_FLAG = re.compile(r"^(--[a-z][\w-]*)(?:[= ].*)?$")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
LINK = re.compile(r"\]\(([^)\s]*)\)")


def code_texts(markdown: str) -> list[str]:
    """Each logical line of the fenced blocks (continuation lines joined) and each inline
    code span outside them, with whitespace collapsed."""
    texts: list[str] = []
    prose: list[str] = []
    block: list[str] | None = None
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if block is not None:
                texts += re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines()
            block = [] if block is None else None
        elif block is not None:
            block.append(line)
        else:
            prose.append(line)
    texts += re.findall(r"`([^`]+)`", "\n".join(prose))
    return [" ".join(text.split()) for text in texts]


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: a for a in parser._actions for option in a.option_strings}


def command_problems(parser: argparse.ArgumentParser, tokens: list[str]) -> Iterator[str]:
    """What in `tokens` (the arguments after the program's name) the parser does not
    know: a flag of the subcommand reached so far, or a subcommand."""
    current, path = parser, [parser.prog]
    skip_value = False
    for token in tokens:
        if COMMAND_END.match(token):
            return
        if skip_value:
            skip_value = False
            continue
        if token.startswith("-") and len(token) > 1:
            flag = token.split("=", 1)[0]
            action = _options(current).get(flag)
            if action is None:
                yield f"{' '.join(path)}: no flag {flag}"
            else:
                skip_value = "=" not in token and action.nargs != 0
            continue
        sub = _subparsers(current)
        if sub is None or PLACEHOLDER.match(token):
            continue  # a positional argument of a leaf command
        if token not in sub.choices:
            yield f"{' '.join(path)}: no subcommand {token!r}"
            return
        current = sub.choices[token]
        path.append(token)


@cache
def parsers() -> dict[str, argparse.ArgumentParser]:
    return {
        "gpu-dra": cli_parser(),
        "gpu-kubelet-plugin": plugin_parser(),
        "gpu-dra-webhook": webhook_parser(),
    }


def every_flag() -> set[str]:
    """The long flags of the plugin, the webhook and every gpu-dra (sub)command."""
    flags: set[str] = set()
    pending = list(parsers().values())
    while pending:
        parser = pending.pop()
        flags |= {f for f in _options(parser) if f.startswith("--")}
        sub = _subparsers(parser)
        if sub is not None:
            pending += list(sub.choices.values())
    return flags


def doc_problems(markdown: str) -> list[str]:
    problems: list[str] = []
    flags = every_flag()
    for text in code_texts(markdown):
        for match in COMMAND.finditer(text):
            tokens = text[match.end() :].split()
            problems += command_problems(parsers()[match[1]], tokens)
        standalone = STANDALONE_FLAG.match(text)
        if standalone and not COMMAND.search(text) and standalone[1] not in flags:
            problems.append(f"`{text}`: no driver flag {standalone[1]}")
        problems += values_problems(text)
    return problems


@cache
def chart_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(VALUES.read_text())
    return values


def values_problems(text: str) -> list[str]:
    """Dotted chart value paths in `text` (`kubeletPlugin.migStrategy`) that values.yaml
    does not have. A map that is empty by default (nodeSelector) takes any key."""
    values = chart_values()
    top = "|".join(re.escape(k) for k in values)
    problems = []
    for match in re.finditer(rf"(?<![\w./$-])((?:{top})(?:\.[A-Za-z][\w-]*)+)", text):
        node: Any = values
        for part in match[1].split("."):
            if isinstance(node, dict) and node and part not in node:
                problems.append(f"`{text}`: no chart value {match[1]}")
                break
            if not isinstance(node, dict) or not node:
                break
            node = node[part]
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchor_problems(doc: Path) -> list[str]:
    problems = []
    for target in LINK.findall(doc.read_text()):
        if "#" not in target or re.match(r"^[a-z]+:", target):
            continue
        file, anchor = target.split("#", 1)
        path = (doc.parent / file) if file else doc
        if path.suffix != ".md" or not path.exists():
            continue  # tests/unit/test_doc_paths.py reports missing files
        anchors = {slug(h) for h in HEADING.findall(path.read_text())}
        if anchor not in anchors:
            problems.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    return problems


# --- the checks themselves work ----------------------------------------------------


def test_the_checker_finds_what_does_not_exist() -> None:
    markdown = """
Run `gpu-dra health clear gpu-3 --yes` or `gpu-dra health clear <device> --force`.
`gpu-dra frobnicate --all` | `--mig-strategy static` | `--no-such-flag`
Set `kubeletPlugin.migStrategy` or `kubeletPlugin.migStrategi`,
`kubeletPlugin.nodeSelector.any-label=on`.

```sh
kubectl exec -n ns "$POD" -- gpu-dra journal show -o yaml > journal.yaml
gpu-kubelet-plugin --node-name n1 \\
  --mig-strategie static
```
"""
    assert sorted(doc_problems(markdown)) == sorted(
        [
            "gpu-dra health clear: no flag --force",
            "gpu-dra: no subcommand 'frobnicate'",
            "`--no-such-flag`: no driver flag --no-such-flag",
            "`kubeletPlugin.migStrategi`: no chart value kubeletPlugin.migStrategi",
            "gpu-kubelet-plugin: no flag --mig-strategie",
        ]
    )


def test_anchors_follow_githubs_rules() -> None:
    assert slug("`gpu-dra health clear DEVICE`") == "gpu-dra-health-clear-device"
    assert slug("Timings and disk (2 vCPU, measured)") == "timings-and-disk-2-vcpu-measured"
    assert slug("2. Node selection") == "2-node-selection"


# --- the guides ----------------------------------------------------------------------


@pytest.mark.parametrize("guide", GUIDES)
def test_the_readme_links_the_guide(guide: str) -> None:
    assert f"](docs/{guide})" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("guide", GUIDES)
def test_the_guide_cites_only_commands_flags_and_values_that_exist(guide: str) -> None:
    assert doc_problems((DOCS / guide).read_text()) == []


@pytest.mark.parametrize("guide", GUIDES)
def test_the_guides_section_links_lead_to_headings(guide: str) -> None:
    assert anchor_problems(DOCS / guide) == []
