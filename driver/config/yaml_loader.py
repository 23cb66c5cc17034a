"""YAML loading that remembers duplicate keys (`driver.config.loader` has the why) and
refuses documents whose aliases expand past `MAX_ALIAS_EXPANSION` nodes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from driver.config.loader import (
    MAX_ALIAS_EXPANSION,
    KeyTrackingDict,
    LoadError,
    NestingError,
    as_text,
    loads_json,
)


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
    text = as_text(data)
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
    text = as_text(data)
    try:
        return loads_json(text)
    except NestingError:
        raise
    except LoadError as json_error:
        try:
            docs = load_yaml_documents(text)
        except LoadError:
            if text.lstrip()[:1] in ("{", "["):  # meant as JSON: its error says more
                raise json_error from None
            raise
    if len(docs) != 1:
        raise LoadError(f"expected exactly one JSON or YAML document, found {len(docs)}")
    return docs[0]
