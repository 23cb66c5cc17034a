"""JSON / YAML loading that remembers duplicate keys instead of silently dropping them.

Both `json.loads` and `yaml.safe_load` keep the last value of a repeated key and
forget the others. Strict config decoding must report duplicates, so the loaders
here build `KeyTrackingDict` mappings: an ordinary `dict` (last value wins, as in
JSON) that additionally records every key that appeared more than once.
`find_raw_problems` walks a loaded value and turns those records (and non-string
keys, which JSON cannot express) into field-path errors.

Use `loads_json` for API bodies (admission reviews, claims read as raw JSON) and
`load_yaml_documents` (`driver.config.yaml_loader`) for files, so the duplicates
survive into the decoder. The YAML half is a module of its own: the plugin's API
client needs only the JSON one.

YAML aliases make a DAG (or, pointing at an enclosing node, a cycle): a few hundred
bytes of anchors can name billions of paths, and every walk that follows them (a
comparison, a copy, a dump) pays for each. So a YAML document whose aliases stand for
more than `MAX_ALIAS_EXPANSION` nodes beyond its own, or whose alias points into
itself, is refused; and `find_raw_problems` visits each shared value once.
"""

from __future__ import annotations

import json
from typing import Any, Final

from driver.config.config_error import FieldError


class KeyTrackingDict(dict[Any, Any]):
    """A dict that remembers keys which were given more than once while loading."""

    __slots__ = ("duplicates",)

    def __init__(self) -> None:
        super().__init__()
        self.duplicates: list[Any] = []


class LoadError(ValueError):
    """The text is not well-formed JSON / YAML."""


class NestingError(LoadError):
    """The text nests deeper than the parser allows."""


#: Nodes a YAML document's aliases may add to it. Merge keys and repeated blocks in
#: hand-written files stay far below; an alias bomb is far above.
MAX_ALIAS_EXPANSION: Final = 10_000


def _pairs_hook(pairs: list[tuple[str, Any]]) -> KeyTrackingDict:
    result = KeyTrackingDict()
    for key, value in pairs:
        if key in result and key not in result.duplicates:
            result.duplicates.append(key)
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def as_text(data: str | bytes | bytearray) -> str:
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as err:
        raise LoadError(f"not valid UTF-8: {err}") from err


def loads_json(data: str | bytes | bytearray) -> Any:
    """Parse JSON; objects become `KeyTrackingDict`. Raises `LoadError`."""
    text = as_text(data)
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook, parse_constant=_reject_constant)
    except RecursionError as err:
        raise NestingError("invalid JSON: too deeply nested") from err
    except ValueError as err:
        raise LoadError(f"invalid JSON: {err}") from err


def join_path(base: str, part: str | int) -> str:
    """Append a field (`a.b`) or list index (`a[0]`) to a path; `""` is the root."""
    if isinstance(part, int):
        return f"{base}[{part}]"
    return f"{base}.{part}" if base else part


def join_key(base: str, key: object) -> str:
    """Append the key of a map whose keys are data, not field names (`a[GPU-1...]`)."""
    return f"{base}[{key}]"


def find_raw_problems(
    value: Any, path: str, maps: frozenset[str] = frozenset()
) -> list[FieldError]:
    """Duplicate keys and non-string keys anywhere inside `value` (iterative, any depth).
    A dict or list reached on several paths (YAML aliases) is checked once, at the first
    path: linear in the distinct values, whatever the aliases expand to. `maps`: the
    fields whose value is a map keyed by data (their keys are written `field[key]`)."""
    problems: list[FieldError] = []
    stack: list[tuple[Any, str, bool]] = [(value, path, False)]
    visited: set[int] = set()
    while stack:
        current, where, is_map = stack.pop()
        if isinstance(current, dict | list):
            if id(current) in visited:
                continue
            visited.add(id(current))
        if isinstance(current, dict):
            join = join_key if is_map else join_path
            problems.extend(
                FieldError(join(where, str(key)), "duplicate key" if is_map else "duplicate field")
                for key in getattr(current, "duplicates", ())
            )
            children: list[tuple[Any, str, bool]] = []
            for key, child in current.items():
                if not isinstance(key, str):
                    message = KEY_NOT_A_STRING if is_map else "field names must be strings"
                    problems.append(FieldError(join(where, str(key)), message))
                    continue
                children.append((child, join(where, key), not is_map and key in maps))
            stack.extend(reversed(children))
        elif isinstance(current, list):
            stack.extend(
                reversed([(child, join_path(where, i), False) for i, child in enumerate(current)])
            )
    return problems


#: A non-string key of a map keyed by data (a YAML file's `0:`; the API server's JSON
#: has none).
KEY_NOT_A_STRING: Final = 'keys must be strings (in YAML, quote them: "0")'


def exceeds_values(value: Any, limit: int) -> bool:
    """Whether `value` holds more than `limit` distinct dicts, lists and scalars (a walk
    that stops as soon as it knows)."""
    count = 0
    stack: list[Any] = [value]
    visited: set[int] = set()
    while stack:
        current = stack.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(current, dict | list):
            if id(current) in visited:
                continue
            visited.add(id(current))
            stack.extend(current.values() if isinstance(current, dict) else current)
    return False
