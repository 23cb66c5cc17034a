"""JSON / YAML loading that remembers duplicate keys instead of silently dropping them.

Both `json.loads` and `yaml.safe_load` keep the last value of a repeated key and
forget the others. Strict config decoding must report duplicates, so the loaders
here build `KeyTrackingDict` mappings: an ordinary `dict` (last value wins, as in
JSON) that additionally records every key that appeared more than once.
`find_raw_problems` walks a loaded value and turns those records (and non-string
keys, which JSON cannot express) into field-path errors.

Use `loads_json` for API bodies (admission reviews, claims read as raw JSON) and
`load_yaml_documents` for files, so the duplicates survive into the decoder.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import yaml
from yaml.nodes import MappingNode

from driver.config.errors import FieldError


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


def _pairs_hook(pairs: list[tuple[str, Any]]) -> KeyTrackingDict:
    result = KeyTrackingDict()
    for key, value in pairs:
        if key in result and key not in result.duplicates:
            result.duplicates.append(key)
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _as_text(data: str | bytes | bytearray) -> str:
    if isinstance(data, str):
        return data
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as err:
        raise LoadError(f"not valid UTF-8: {err}") from err


def loads_json(data: str | bytes | bytearray) -> Any:
    """Parse JSON; objects become `KeyTrackingDict`. Raises `LoadError`."""
    text = _as_text(data)
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook, parse_constant=_reject_constant)
    except RecursionError as err:
        raise NestingError("invalid JSON: too deeply nested") from err
    except ValueError as err:
        raise LoadError(f"invalid JSON: {err}") from err


class _TrackingLoader(yaml.SafeLoader):
    """SafeLoader whose mappings are `KeyTrackingDict`s."""


def _construct_tracking_map(
    loader: _TrackingLoader, node: MappingNode
) -> Iterator[KeyTrackingDict]:
    data = KeyTrackingDict()
    yield data
    explicit = sum(1 for key_node, _ in node.value if key_node.tag != "tag:yaml.org,2002:merge")
    loader.flatten_mapping(node)
    merged = len(node.value) - explicit  # `<<` merge keys come first; explicit keys override
    explicit_keys: set[Any] = set()
    for position, (key_node, value_node) in enumerate(node.value):
        key = loader.construct_object(key_node, deep=False)
        try:
            hash(key)
        except TypeError as err:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                "found unhashable key",
                key_node.start_mark,
            ) from err
        if position >= merged:
            if key in explicit_keys and key not in data.duplicates:
                data.duplicates.append(key)
            explicit_keys.add(key)
        data[key] = loader.construct_object(value_node, deep=False)


_TrackingLoader.add_constructor("tag:yaml.org,2002:map", _construct_tracking_map)


def load_yaml_documents(data: str | bytes | bytearray) -> list[Any]:
    """Parse a (multi-document) YAML stream. Empty documents are dropped. Raises `LoadError`."""
    text = _as_text(data)
    try:
        return [doc for doc in yaml.load_all(text, Loader=_TrackingLoader) if doc is not None]
    except RecursionError as err:
        raise NestingError("invalid YAML: too deeply nested") from err
    except (yaml.YAMLError, ValueError) as err:  # ValueError: int() of a huge integer
        raise LoadError(f"invalid YAML: {err}") from err


def loads_json_or_yaml(data: str | bytes | bytearray) -> Any:
    """One document: JSON if it parses as JSON, else YAML. Raises `LoadError`."""
    text = _as_text(data)
    try:
        return loads_json(text)
    except NestingError:
        raise
    except LoadError as json_error:
        if text.lstrip()[:1] in ("{", "["):
            try:
                docs = load_yaml_documents(text)
            except LoadError:
                raise json_error from None
        else:
            docs = load_yaml_documents(text)
    if len(docs) != 1:
        raise LoadError(f"expected exactly one JSON or YAML document, found {len(docs)}")
    return docs[0]


def join_path(base: str, part: str | int) -> str:
    """Append a field (`a.b`) or list index (`a[0]`) to a path; `""` is the root."""
    if isinstance(part, int):
        return f"{base}[{part}]"
    return f"{base}.{part}" if base else part


def find_raw_problems(value: Any, path: str) -> list[FieldError]:
    """Duplicate keys and non-string keys anywhere inside `value` (iterative, any depth)."""
    problems: list[FieldError] = []
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        current, where = stack.pop()
        if isinstance(current, dict):
            for key in getattr(current, "duplicates", ()):
                problems.append(FieldError(join_path(where, str(key)), "duplicate field"))
            children: list[tuple[Any, str]] = []
            for key, child in current.items():
                if not isinstance(key, str):
                    problems.append(
                        FieldError(join_path(where, str(key)), "field names must be strings")
                    )
                    continue
                children.append((child, join_path(where, key)))
            stack.extend(reversed(children))
        elif isinstance(current, list):
            stack.extend(
                reversed([(child, join_path(where, i)) for i, child in enumerate(current)])
            )
    return problems
