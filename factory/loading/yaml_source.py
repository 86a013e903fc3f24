"""Read one YAML file into plain data plus the line of every value.

PyYAML's safe composer gives a node graph with positions; we build the data
ourselves so that we can (a) record ``path -> line`` for error messages,
(b) refuse tags other than YAML's core types (``!!python/...`` and custom
tags), (c) refuse duplicate keys, which PyYAML would silently collapse, and
(d) bound alias expansion, so a "billion laughs" document or a recursive
alias fails fast instead of exhausting memory downstream, and (e) bound
nesting: libyaml's composer recurses in C, so ``[[[...]]]`` 100000 deep
crashes the interpreter outright, and a few thousand exhaust Python's stack
in everything that walks the data afterwards. A first pass over libyaml's
event stream (iterative, cheap) measures depth and size before composing.
Only regular files are read: a FIFO would block the command for ever, and a
folder or device is never a blueprint or a recipe.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from factory.dotted_paths import join_path
from factory.errors import BlueprintError, Diagnostic, SourceMap

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_NODES",
    "MERGE_KEYS_IN_A_BLUEPRINT",
    "MERGE_KEYS_IN_A_RECIPE",
    "MERGE_KEYS_IN_EITHER",
    "display_path",
    "first_line",
    "read_yaml",
    "read_yaml_text",
]

MAX_NODES = 100_000
"""Most nodes a document may expand to once aliases are followed; blueprints have ~300."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists; blueprints nest 5 deep and recipes 6."""
MAX_BYTES = 16 * 2**20
"""Largest file read; blueprints and recipes are a few KiB."""

# libyaml's parser is ~10x faster than PyYAML's pure-Python one; both give marked nodes.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CORE = "tag:yaml.org,2002:"
_ALLOWED_TAGS = {_CORE + t for t in ("str", "int", "float", "bool", "null", "map", "seq")}

# What a '<<' key should have been, by the kind of document it is in: blueprints
# build on others with 'extends', recipes have no 'extends', and both take anchors.
_NO_MERGE_KEYS = "YAML merge keys ('<<') are not supported"
_ALIASES = "an anchor and an alias (&name on a value, *name where it repeats)"
MERGE_KEYS_IN_A_BLUEPRINT = (
    f"{_NO_MERGE_KEYS}; build on another blueprint with 'extends', or repeat a value with "
    f"{_ALIASES}"
)
MERGE_KEYS_IN_A_RECIPE = (
    f"{_NO_MERGE_KEYS} and a data recipe has no 'extends'; repeat a value with {_ALIASES}"
)
MERGE_KEYS_IN_EITHER = (
    f"{_NO_MERGE_KEYS}; repeat a value with {_ALIASES} (a blueprint may also use 'extends')"
)


class _Builder:
    def __init__(self, file: str, merge_keys: str) -> None:
        self.file = file
        self.merge_keys = merge_keys
        self.source_map = SourceMap(file)
        self.visited = 0
        self.active: set[int] = set()
        self.scalars = yaml.constructor.SafeConstructor()

    def fail(self, node: yaml.Node, path: str, message: str) -> BlueprintError:
        mark = node.start_mark
        return BlueprintError(
            [Diagnostic(path, message, self.file, mark.line + 1, column=mark.column + 1)]
        )

    def build(self, node: yaml.Node, path: str, depth: int = 0) -> Any:
        self.visited += 1
        if self.visited > MAX_NODES:
            raise self.fail(
                node, path, f"document expands to more than {MAX_NODES} nodes (alias bomb?)"
            )
        if node.tag not in _ALLOWED_TAGS:
            raise self.fail(
                node, path, f"tag {node.tag!r} is not allowed; blueprints are plain data"
            )
        self.source_map.record(path, self.file, *_position(node.start_mark))
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node, path)
        if depth >= MAX_DEPTH:  # aliases can nest deeper than the text does
            raise self.fail(node, path, f"nested more than {MAX_DEPTH} levels deep")
        if id(node) in self.active:
            raise self.fail(node, path, "recursive alias: a value contains itself")
        self.active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                return [
                    self.build(item, join_path(path, i), depth + 1)
                    for i, item in enumerate(node.value)
                ]
            return self._mapping(node, path, depth)
        finally:
            self.active.discard(id(node))

    def _scalar(self, node: yaml.ScalarNode, path: str) -> Any:
        try:
            return self.scalars.construct_object(node)
        except (ValueError, yaml.YAMLError) as exc:
            if node.tag == _CORE + "int":  # more digits than Python converts (4300)
                message = f"an integer of {len(node.value)} characters is too long"
            else:
                message = f"unreadable value: {first_line(exc)}"
            raise self.fail(node, path, message) from None

    def _mapping(self, node: yaml.MappingNode, path: str, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _CORE + "merge":
                raise self.fail(key_node, path, self.merge_keys)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _CORE + "str":
                raise self.fail(
                    key_node, path, f"keys must be plain strings, got {key_node.value!r}"
                )
            key = key_node.value
            if key in out:
                first = self.source_map.locate(join_path(path, key))[1]
                raise self.fail(
                    key_node, join_path(path, key), f"duplicate key (first set on line {first})"
                )
            out[key] = self.build(value_node, join_path(path, key), depth + 1)
            # Point at the key's line: a nested section's own node starts a line below it.
            self.source_map.record(join_path(path, key), self.file, *_position(key_node.start_mark))
        return out


def _position(mark: yaml.Mark) -> tuple[int, int]:
    """1-based line and column, as editors and CI annotations count them."""
    return mark.line + 1, mark.column + 1


def first_line(exc: BaseException) -> str:
    """An exception's message without the context lines PyYAML and OmegaConf append."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_shape(text: str, file: str) -> None:
    """Refuse documents nested deeper than MAX_DEPTH or larger than MAX_NODES, before composing."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.NodeEvent) and not isinstance(event, yaml.AliasEvent):
            nodes += 1
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        line = event.start_mark.line + 1
        if depth > MAX_DEPTH:
            message = f"nested more than {MAX_DEPTH} levels deep"
            raise BlueprintError([Diagnostic("", message, file, line)])
        if nodes > MAX_NODES:
            message = f"more than {MAX_NODES} values; blueprints and recipes have a few hundred"
            raise BlueprintError([Diagnostic("", message, file, line)])


def read_yaml_text(
    text: str, file: str, merge_keys: str = MERGE_KEYS_IN_EITHER
) -> tuple[Any, SourceMap]:
    """Parse ``text`` (the contents of ``file``) into data and a source map.

    ``merge_keys`` is the message for a ``<<`` key: what the document's kind
    offers instead (``MERGE_KEYS_IN_A_BLUEPRINT``, ``MERGE_KEYS_IN_A_RECIPE``).
    """
    try:
        _check_shape(text, file)
        root = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, column = _position(mark) if mark else (0, 0)
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        message = f"malformed YAML: {problem}"
        raise BlueprintError([Diagnostic("", message, file, line, column=column)]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML forbids, e.g. NUL
        line = text[: exc.position].count("\n") + 1
        char = exc.character if isinstance(exc.character, str) else chr(exc.character)
        message = f"malformed YAML: character {char!r} is not allowed"
        raise BlueprintError([Diagnostic("", message, file, line)]) from None
    except yaml.YAMLError as exc:
        message = f"malformed YAML: {first_line(exc)}"
        raise BlueprintError([Diagnostic("", message, file, 0)]) from None
    if root is None:
        raise BlueprintError([Diagnostic("", "the document is empty", file, 1)])
    builder = _Builder(file, merge_keys)
    return builder.build(root, ""), builder.source_map


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when possible: shorter, and clickable."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError, RuntimeError):
        return str(path)


def _file_kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _read_regular_file(path: Path, file: str) -> bytes:
    """At most ``MAX_BYTES + 1`` bytes of ``path``, refusing anything but a regular file.

    Opened without blocking and checked on the open descriptor: opening a FIFO
    for reading would wait for a writer for ever, and checking before opening
    would leave a window for the path to change.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        message = f"{_file_kind(mode)}, not a YAML file"
        raise BlueprintError([Diagnostic("", message, file, 0)])
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as stream:
        return stream.read(MAX_BYTES + 1)


def read_yaml(
    path: Path, display: str | None = None, merge_keys: str = MERGE_KEYS_IN_EITHER
) -> tuple[Any, SourceMap]:
    """Read and parse a YAML file; unreadable files become diagnostics too.

    ``merge_keys`` is as for :func:`read_yaml_text`.
    """
    file = display or str(path)
    try:
        raw = _read_regular_file(path, file)
    except FileNotFoundError:
        raise BlueprintError([Diagnostic("", "file not found", file, 0)]) from None
    except OSError as exc:
        raise BlueprintError(
            [Diagnostic("", f"cannot read file: {exc.strerror}", file, 0)]
        ) from None
    except ValueError:  # a NUL byte in the path
        raise BlueprintError([Diagnostic("", "not a file path", file, 0)]) from None
    if len(raw) > MAX_BYTES:
        raise BlueprintError([Diagnostic("", f"larger than {MAX_BYTES} bytes", file, 0)])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise BlueprintError(
            [Diagnostic("", f"not UTF-8 (byte {exc.start})", file, line)]
        ) from None
    return read_yaml_text(text, file, merge_keys)
