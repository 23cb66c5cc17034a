"""JSON / YAML loading that remembers duplicate keys instead of silently dropping them.

Both `json.loads` and `yaml.safe_load` keep the last value of a repeated key and
forget the others. Strict config decoding must report duplicates, so the loaders
here build `KeyTrackingDict` mappings: an ordinary `dict` (last value wins, as in
JSON) that additionally records every key that appeared more than once.
`find_raw_problems` walks a loaded value and turns those records (and non-string
keys, which JSON cannot express) into field-path errors.

Use `loads_json` for API bodies (admission reviews, claims read as raw JSON) and
`load_yaml_documents` for files, so the duplicates survive into the decoder.

YAML aliases make a DAG (or, pointing at an enclosing node, a cycle): a few hundred
bytes of anchors can name billions of paths, and every walk that follows them (a
comparison, a copy, a dump) pays for each. So a YAML document whose aliases stand for
more than `MAX_ALIAS_EXPANSION` nodes beyond its own, or whose alias points into
itself, is refused; and `find_raw_problems` visits each shared value once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

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
    """SafeLoader whose mappings are `KeyTrackingDict`s, refusing alias bombs and
    recursive aliases before anything is constructed."""

    def compose_document(self) -> Node | None:
        node = super().compose_document()
        if node is None:
            return None
        expanded, distinct = _alias_expansion(node)
        if expanded - distinct > MAX_ALIAS_EXPANSION:
            raise LoadError(f"aliases expand the document by more than {MAX_ALIAS_EXPANSION} nodes")
        return node


def _children(node: Node) -> list[Node]:
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def _alias_expansion(root: Node) -> tuple[int, int]:
    """(nodes of the tree `root` stands for with every alias expanded, distinct nodes),
    in time linear in the distinct nodes. Raises `LoadError` for an alias to an
    enclosing node."""
    sizes: dict[int, int] = {}
    enclosing: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            enclosing.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
        elif id(node) in enclosing:
            mark = node.start_mark
            raise LoadError(f"recursive alias at line {mark.line + 1}, column {mark.column + 1}")
        elif id(node) not in sizes:
            enclosing.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))
    return sizes[id(root)], len(sizes)


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
    except yaml.YAMLError as err:
        raise LoadError(f"invalid YAML: {_describe_yaml_error(err, text)}") from err
    except ValueError as err:  # int() of a huge integer; an alias bomb (LoadError)
        raise LoadError(f"invalid YAML: {err}") from err


def _position(line: int, column: int) -> str:
    return f"line {line + 1}, column {column + 1}"


def _describe_yaml_error(err: yaml.YAMLError, text: str) -> str:
    """PyYAML's error on one line, positions as line and column of `text` (PyYAML's own
    text spans several lines and names the stream `<unicode string>`)."""
    if isinstance(err, yaml.reader.ReaderError):
        before = text[: err.position]
        where = _position(before.count("\n"), len(before) - (before.rfind("\n") + 1))
        return f"{where}: unacceptable character #x{err.character:04x}: {err.reason}"
    if not isinstance(err, yaml.MarkedYAMLError):
        return " ".join(str(err).split())
    message = err.problem or err.context or "malformed"
    context = err.context_mark
    if err.problem and err.context and context is not None:
        message += f" ({err.context} from {_position(context.line, context.column)})"
    mark = err.problem_mark or context
    return message if mark is None else f"{_position(mark.line, mark.column)}: {message}"


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
    """Duplicate keys and non-string keys anywhere inside `value` (iterative, any depth).
    A dict or list reached on several paths (YAML aliases) is checked once, at the first
    path: linear in the distinct values, whatever the aliases expand to."""
    problems: list[FieldError] = []
    stack: list[tuple[Any, str]] = [(value, path)]
    visited: set[int] = set()
    while stack:
        current, where = stack.pop()
        if isinstance(current, dict | list):
            if id(current) in visited:
                continue
            visited.add(id(current))
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
