"""Every command the docs tell a user to run names something that exists, with arguments it
accepts: read out of README.md, docs/, demo/, bench/ and hack/*/README.md (their shell code
blocks and inline code), not kept in a second list.

- `make T...`: each target is one of the Makefile's;
- `hack/...`, `demo/...` scripts: the file exists and is executable; its subcommand and
  every `--flag` shown occur in the script (or the hack/lib files it sources);
- `gpu-dra ...` (also `.venv/bin/gpu-dra`): the CLI's own parser accepts the arguments;
- `.venv/bin/python -m bench.X ...`: the module exists and names every `--flag` shown.

Other programs (kubectl, helm, docker, curl) are not this project's to check.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from driver.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "hack").glob("*/README.md"),
        REPO / "demo" / "README.md",
        REPO / "bench" / "README.md",
    ]
)
SHELL_BLOCKS = {"", "sh", "bash", "shell", "console"}
PROJECT_COMMAND = re.compile(r"^(sudo\s+)?(make\s|hack/|demo/|\.venv/bin/|gpu-dra\s)")
SEPARATORS = {"&&", "||", ";", "|"}


@dataclass(frozen=True)
class DocCommand:
    where: str
    words: tuple[str, ...]
    # Inline code in prose may name a command without its required arguments
    # (`gpu-dra health clear`) or a file (`hack/lib/node.sh`); a code block runs it.
    inline: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def _shell_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """Lines of shell code blocks (continuations joined, `$ ` prompts dropped) and inline
    code spans outside blocks (flagged True), with their line numbers."""
    in_block, language, pending, start = False, "", "", 0
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            in_block, language = not in_block, fence.group(1) if not in_block else ""
            continue
        if in_block:
            if language not in SHELL_BLOCKS:
                continue
            stripped = re.sub(r"^\s*\$ ", "", line) if not pending else line
            if not pending:
                start = number
            if stripped.rstrip().endswith("\\"):
                pending += stripped.rstrip()[:-1] + " "
                continue
            yield start, pending + stripped, False
            pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span, True


def _commands(where: str, line: str, inline: bool) -> Iterator[DocCommand]:
    line = line.strip()
    if not PROJECT_COMMAND.match(line):
        return
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:  # an unclosed quote: an example spread over lines, not a command
        return
    command: list[str] = []
    for word in [*words, ";"]:
        if word in SEPARATORS or set(word) <= set(";&|"):
            if command and PROJECT_COMMAND.match(" ".join(command) + " "):
                yield DocCommand(where, tuple(command), inline)
            command = []
        elif word != "sudo" and not (not command and "=" in word):
            command.append(word)


def doc_commands() -> list[DocCommand]:
    found: dict[tuple[str, ...], DocCommand] = {}
    for doc in DOCS:
        if not doc.exists():
            continue
        for number, line, inline in _shell_lines(doc.read_text()):
            for command in _commands(f"{doc.relative_to(REPO)}:{number}", line, inline):
                found.setdefault(command.words, command)
    return list(found.values())


COMMANDS = doc_commands()


def _makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


def _script_sources(script: Path) -> str:
    """The script and the hack/lib files it sources."""
    text = script.read_text()
    for lib in re.findall(r'source "\$\w+(?:/\.\.)?/(lib/[\w.-]+\.sh|hack/lib/[\w.-]+\.sh)"', text):
        path = REPO / "hack" / lib if lib.startswith("lib/") else REPO / lib
        if path.exists():
            text += path.read_text()
    return text


def _is_placeholder(word: str) -> bool:
    return bool(re.search(r"[$<>\[\]]|\.\.\.", word)) or word.isupper() or "=" in word


def check(command: DocCommand) -> str | None:
    """What is wrong with `command`, or None."""
    program, *args = command.words
    if "..." in args:  # `gpu-dra mock ...`: what follows is left to the reader
        args = args[: args.index("...")]
    if program.endswith("/") or (command.inline and not args and "." in Path(program).name):
        # A directory, or a file named in prose (`hack/lib/node.sh`, `demo/09-....yaml`).
        return None if (REPO / program).exists() else f"{program} does not exist"
    if program == "make":
        if "-C" in args:  # another project's Makefile (e.g. NVIDIA's mock library)
            return None
        unknown = [a for a in args if "=" not in a and a not in _makefile_targets()]
        return f"no make target {unknown}" if unknown else None
    if program.startswith(("hack/", "demo/")):
        script = REPO / program
        if not script.is_file():
            return f"{program} does not exist"
        if not script.stat().st_mode & 0o111:
            return f"{program} is not executable"
        source = _script_sources(script)
        shown = [a for a in args if a.startswith("--") and not _is_placeholder(a.split("=")[0])]
        if args and not args[0].startswith("-") and not _is_placeholder(args[0]):
            shown.insert(0, args[0])
        missing = [a.split("=")[0] for a in shown if a.split("=")[0] not in source]
        return f"{program} knows no {missing}" if missing else None
    if program in ("gpu-dra", ".venv/bin/gpu-dra"):
        errors = io.StringIO()
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            try:
                build_parser().parse_args(args)
            except SystemExit as exit_:
                if exit_.code in (0, None):  # --version, --help
                    return None
                message = errors.getvalue().strip().splitlines()[-1]
                # Prose names a subcommand or an option without its values.
                named_only = command.inline and (
                    " required" in message or "expected one argument" in message
                )
                if not named_only:
                    return message
        return None
    if program == ".venv/bin/python":
        if args[:1] != ["-m"]:
            return None  # an inline script (a here-document)
        module = REPO / Path(*args[1].split("."))
        path = module.with_suffix(".py") if module.with_suffix(".py").exists() else module
        main = path / "__main__.py" if path.is_dir() else path
        if not main.exists():
            return f"no module {args[1]}"
        sources = "".join(p.read_text() for p in (path.rglob("*.py") if path.is_dir() else [path]))
        if path.is_file():
            sources += "".join(p.read_text() for p in path.parent.glob("*.py"))
        missing = [a for a in args[2:] if a.startswith("--") and f'"{a}"' not in sources]
        return f"{args[1]} has no option {missing}" if missing else None
    if program.startswith(".venv/bin/"):
        return None if program.removeprefix(".venv/bin/") in _console_scripts() else "unknown"
    return None


def _console_scripts() -> set[str]:
    text = (REPO / "pyproject.toml").read_text()
    block = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return {*re.findall(r"^([\w-]+)\s*=", block, re.M), "python", "pytest", "ruff", "mypy"}


def test_the_docs_name_the_commands_users_are_told_to_run() -> None:
    # The extraction must find the README's own quick start, or the check below proves
    # nothing.
    shown = {shlex.join(c.words) for c in COMMANDS}
    for expected in (
        "make demo",
        "make test",
        "make venv",
        ".venv/bin/gpu-dra inventory --mock --node-name n1 -o table",
        "hack/gpu-tier-bundle.sh pack DIR",
        "make e2e-kep5322",
    ):
        assert expected in shown, f"{expected!r} not found in the docs' commands"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_each_documented_command_exists_with_the_arguments_shown(command: DocCommand) -> None:
    problem = check(command)
    assert problem is None, f"{command}: {problem}"


def test_the_check_refuses_what_does_not_exist() -> None:
    assert check(DocCommand("x", ("make", "kind-upp"))) is not None
    assert check(DocCommand("x", ("hack/local-cluster.sh", "upp"))) is not None
    assert check(DocCommand("x", ("hack/local-cluster.sh", "up", "--with-nodes"))) is not None
    assert check(DocCommand("x", ("hack/no-such.sh",))) is not None
    assert check(DocCommand("x", ("gpu-dra", "inventory", "--mok"))) is not None
    assert check(DocCommand("x", (".venv/bin/python", "-m", "bench.nothing"))) is not None
    assert check(DocCommand("x", (".venv/bin/python", "-m", "bench.run", "--frob"))) is not None
    assert check(DocCommand("x", ("hack/local-cluster.sh", "up", "--with-node"))) is None
    assert check(DocCommand("x", ("gpu-dra", "mock", "xid"))) is not None
    assert check(DocCommand("x", ("gpu-dra", "mock", "xid"), inline=True)) is None
    assert check(DocCommand("x", ("gpu-dra", "mock", "xyd"), inline=True)) is not None
    assert check(DocCommand("x", ("hack/lib/nodes.sh",), inline=True)) is not None
