"""The value types of the plugin's settings (`driver.plugin.options.settings`): each turns a
flag's or variable's text into its value, or raises ValueError saying why."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from driver.devices.device_types import MigStrategy
from driver.devices.formatting import profile_label
from driver.errors import parse_permanent_errors
from driver.health.xid import TAINT_EFFECTS, parse_taint_effect, parse_xid_list
from driver.plugin.options.host_inputs import check_path

MIG_STRATEGIES = tuple(m.value for m in MigStrategy)
TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
FALSE_WORDS = frozenset({"false", "0", "no", "off"})
MAX_PORT = 65535


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
        return value

    return parse


def mig_strategy(value: str) -> MigStrategy:
    return MigStrategy(choice(*MIG_STRATEGIES)(value))


# A MIG GPU-instance profile as NVML names it (1g.10gb, 1g.10gb+me) or as labelled
# (1g10gb, 1g10gb-me).
_PROFILE = re.compile(r"^[0-9]+g(\.[0-9]+gb([+.-][a-z0-9.+-]*)?|[0-9]+gb(-[a-z0-9-]*)?)$")


def mig_profiles(value: str) -> tuple[str, ...]:
    """MIG profiles, as NVML names them ("1g.10gb,3g.40gb") or as device names label
    them ("1g10gb_3g40gb", what a node label can hold), each once; as labels."""
    labels: list[str] = []
    for item in re.split(r"[,_]", value.strip().lower()):
        item = item.strip()
        if not item:
            continue
        if not _PROFILE.match(item):
            raise ValueError(f"{item!r} is not a MIG profile (like 1g.10gb or 1g10gb)")
        if (label := profile_label(item)) not in labels:
            labels.append(label)
    return tuple(labels)


def boolean(value: str) -> bool:
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{value!r} is not a boolean (true or false)")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value.strip(), 10)
        except ValueError:
            raise ValueError(f"{value!r} is not an integer") from None
        if number < minimum:
            raise ValueError(f"must be >= {minimum}, got {number}")
        if maximum is not None and number > maximum:
            raise ValueError(f"must be <= {maximum}, got {number}")
        return number

    return parse


def http_port(value: str) -> int:
    port = integer(-1, MAX_PORT)(value)
    if port == 0:  # the kernel would pick one that no probe or scrape could find
        raise ValueError(f"must be a port (1..{MAX_PORT}) or -1 (off), got 0")
    return port


def taint_effect(value: str) -> str:
    try:
        return parse_taint_effect(value, flag="")
    except ValueError:
        raise ValueError(f"{value!r} is not one of {', '.join(TAINT_EFFECTS)}") from None


def xid_list(value: str) -> str:
    """Checked, kept as given (`XidPolicy.from_flags` reads it)."""
    try:
        parse_xid_list(value, "")
    except ValueError as err:
        raise ValueError(str(err).removeprefix(": ")) from None
    return value


def permanent_errors(value: str) -> str:
    parse_permanent_errors(value)
    return value


def written_dir(value: str) -> Path:
    check_path(value, written=True)
    return Path(value)


def read_path(value: str) -> Path:
    check_path(value, written=False)
    return Path(value)


def read_path_text(value: str) -> str:
    check_path(value, written=False)
    return value


def mock_fleet(value: str) -> str:
    """A fleet YAML file or a built-in fleet's name, loaded to check it."""
    from driver.nvml.selection import check_mock_fleet  # NVML's modules: only when needed

    check_mock_fleet(value)
    return value
