"""README's configuration table lists every flag of gpu-kubelet-plugin with its
environment variable and default, as the plugin parses them."""

from __future__ import annotations

import re
from pathlib import Path

from driver.plugin.options.flags import PLUGIN_SETTINGS, flag_env

README = Path(__file__).resolve().parents[2] / "README.md"


def _table_rows() -> dict[str, list[str]]:
    """The configuration table's rows by each flag they name (`--x`, `-v`)."""
    text = README.read_text()
    section = text.split("## Configuration (gpu-kubelet-plugin)", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if not line.startswith("| `-"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for flag in re.findall(r"`(-[-a-z0-9]+)`", cells[0]):
            rows[flag] = cells
    return rows


def test_every_flag_has_a_row_with_its_env_and_default() -> None:
    rows = _table_rows()
    problems = []
    for setting in PLUGIN_SETTINGS:
        row = rows.get(setting.short or setting.flag) or rows.get(setting.flag)
        if row is None:
            problems.append(f"{setting.flag}: no row")
            continue
        if f"`{flag_env(setting.flag)}`" not in row[1]:
            problems.append(f"{setting.flag}: env {flag_env(setting.flag)} not in {row[1]!r}")
        if setting.default and f"`{setting.default}`" not in row[2]:
            problems.append(f"{setting.flag}: default {setting.default!r} not in {row[2]!r}")
    assert not problems, "\n".join(problems)


def test_no_row_names_a_flag_the_plugin_does_not_have() -> None:
    known = {s.flag for s in PLUGIN_SETTINGS} | {s.short for s in PLUGIN_SETTINGS if s.short}
    assert set(_table_rows()) <= known
