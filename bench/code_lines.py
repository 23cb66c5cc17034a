"""Hand-written product lines per package, like for like with NVIDIA's kubelet plugin:
`python -m bench.code_lines [REV ...]` prints, for each git revision (default HEAD),
the `wc -l` of every `driver/**/*.py` except the operator CLI (`driver/cli/`), the mock
NVML (`driver/nvml/mock/`) and the generated protobuf code (`driver/proto/`), by
package, and how many of those lines are code, docstrings, comments and blank.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import Counter
from pathlib import PurePosixPath

LEFT_OUT = ("driver/cli/", "driver/nvml/mock/", "driver/proto/")
KINDS = ("code", "doc", "comment", "blank")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def product_files(rev: str) -> list[str]:
    names = _git("ls-tree", "-r", "--name-only", rev, "driver/").splitlines()
    return [n for n in names if n.endswith(".py") and not n.startswith(LEFT_OUT)]


def line_kinds(source: str) -> Counter[str]:
    """Each line counted once: a docstring's lines as `doc`, else blank, comment or code."""
    lines = source.splitlines()
    kinds = [
        "blank" if not s.strip() else "comment" if s.strip()[0] == "#" else "code" for s in lines
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                end = first.end_lineno or first.lineno
                kinds[first.lineno - 1 : end] = ["doc"] * (end - first.lineno + 1)
    return Counter(kinds)


def package(path: str) -> str:
    parts = PurePosixPath(path).parts
    return parts[1] if len(parts) > 2 else "(top level)"


def count(rev: str) -> dict[str, Counter[str]]:
    by_package: dict[str, Counter[str]] = {}
    for path in product_files(rev):
        by_package.setdefault(package(path), Counter()).update(
            line_kinds(_git("show", f"{rev}:{path}"))
        )
    return by_package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", default=["HEAD"])
    revs = parser.parse_args().revs
    counts = {rev: count(rev) for rev in revs}
    packages = sorted(
        {p for c in counts.values() for p in c}, key=lambda p: (p == "(top level)", p)
    )
    print("| package | " + " | ".join(revs) + " |")
    print("|---|" + "---:|" * len(revs))
    for name in packages:
        cells = (str(sum(counts[rev].get(name, Counter()).values())) for rev in revs)
        print(f"| {name} | " + " | ".join(cells) + " |")
    totals = {rev: sum((c for c in counts[rev].values()), Counter()) for rev in revs}
    print("| **total** | " + " | ".join(f"**{sum(totals[r].values()):,}**" for r in revs) + " |")
    for kind in KINDS:
        print(f"| of which {kind} | " + " | ".join(f"{totals[r][kind]:,}" for r in revs) + " |")


if __name__ == "__main__":
    main()
