"""The packages the real-GPU tier needs, as a hashed requirements file cut from the lock.

    .venv/bin/python hack/bundle_requirements.py        the requirements file on stdout
    .venv/bin/python hack/bundle_requirements.py --why  each package and what needs it

Nothing here is kept by hand: the roots are the project's own dependencies
(pyproject.toml), the pytest plugins its pytest configuration requires, and the
distributions of every third-party module that `driver/` and `tests/gpu/` (with the
`tests` modules they load, conftest.py included) import; the closure follows the lock's
`# via` lines, so whatever a root pulls in comes along. Import names are mapped to
distributions by the installed environment (importlib.metadata), so run it with the
project's venv. hack/gpu-tier-bundle.sh pack calls it.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL_PACKAGES = ("driver", "tests")
SELF = "gpu-dra-driver"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class LockedPackage:
    name: str
    lines: list[str] = field(default_factory=list)
    needed_by: set[str] = field(default_factory=set)


def parse_lock(text: str) -> dict[str, LockedPackage]:
    """Each `name==version \\` block of a pip-compile lock with its `--hash` lines and the
    packages its `# via` comment names (the project itself left out)."""
    packages: dict[str, LockedPackage] = {}
    current: LockedPackage | None = None
    in_via = False
    for line in text.splitlines():
        if re.match(r"^[A-Za-z0-9]", line):
            current = LockedPackage(canonical(line.split("==", 1)[0]), [line])
            packages[current.name] = current
            in_via = False
        elif current is None:
            continue
        elif line.lstrip().startswith("--hash"):
            current.lines.append(line)
        elif m := re.match(r"^\s+# via\s*(.*)$", line):
            in_via = True
            if m.group(1):
                current.needed_by.add(canonical(m.group(1).split()[0]))
        elif in_via and (m := re.match(r"^\s+#\s+(\S+)", line)):
            current.needed_by.add(canonical(m.group(1)))
    for package in packages.values():
        package.needed_by.discard(SELF)
    return packages


def _python_files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _local_files(module: str, names: Iterable[str], repo: Path) -> list[Path]:
    """The files of the `tests` module an import names (`from tests.gpu import x`: the
    package's __init__.py and, where x is a submodule, x.py)."""
    target = repo / Path(*module.split("."))
    candidates = [target.with_suffix(".py"), target / "__init__.py"]
    candidates += [target / f"{name}.py" for name in names]
    return [path for path in candidates if path.is_file()]


def imported_modules(sources: Iterable[Path], repo: Path = REPO) -> set[str]:
    """Top-level names of the modules `sources` import, following imports of the `tests`
    package into the files they name."""
    seen: set[Path] = set()
    pending = list(_python_files(sources))
    names: set[str] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imports = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imports = [(node.module, [alias.name for alias in node.names])]
            else:
                continue
            for module, imported in imports:
                names.add(module.split(".")[0])
                if module.split(".")[0] == "tests":
                    pending += _local_files(module, imported, repo)
    return names


def third_party_distributions(modules: Iterable[str]) -> dict[str, str]:
    """distribution -> an import name of it, for modules that are neither the standard
    library's nor the project's; a module no installed distribution provides is an error."""
    provided = importlib.metadata.packages_distributions()
    found: dict[str, str] = {}
    for module in sorted(modules):
        if module in sys.stdlib_module_names or module in LOCAL_PACKAGES or module == "__future__":
            continue
        if module not in provided:
            raise SystemExit(f"bundle_requirements: no installed distribution provides {module!r}")
        for dist in provided[module]:
            found.setdefault(canonical(dist), module)
    return found


def roots(repo: Path = REPO) -> dict[str, str]:
    """Each root package and why it is one."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())
    why: dict[str, str] = {}
    for requirement in project["project"]["dependencies"]:
        why[canonical(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])] = "pyproject.toml"
    pytest_ini = project["tool"]["pytest"]["ini_options"]
    for plugin in pytest_ini.get("required_plugins", []):
        why[canonical(re.split(r"[<>=!~ ]", plugin, maxsplit=1)[0])] = "required_plugins"
    sources = [repo / "driver", repo / "tests" / "gpu", repo / "tests" / "conftest.py"]
    for dist, module in third_party_distributions(imported_modules(sources, repo)).items():
        why.setdefault(dist, f"import {module}")
    return why


def closure(lock: dict[str, LockedPackage], root_names: Iterable[str]) -> dict[str, str]:
    """Every locked package a root needs, directly or through others: name -> why."""
    why = {name: "root" for name in root_names}
    missing = sorted(set(why) - set(lock))
    if missing:
        raise SystemExit(f"bundle_requirements: not in requirements.lock: {', '.join(missing)}")
    changed = True
    while changed:
        changed = False
        for package in lock.values():
            parents = sorted(package.needed_by & set(why))
            if package.name not in why and parents:
                why[package.name] = f"needed by {parents[0]}"
                changed = True
    return why


def bundle(repo: Path = REPO) -> tuple[dict[str, LockedPackage], dict[str, str]]:
    lock = parse_lock((repo / "requirements.lock").read_text())
    root_why = roots(repo)
    why = closure(lock, root_why)
    why.update(root_why)
    return lock, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--why", action="store_true", help="each package and what needs it")
    args = parser.parse_args(argv)
    lock, why = bundle()
    for name in sorted(why):
        print(f"{name}: {why[name]}" if args.why else "\n".join(lock[name].lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
