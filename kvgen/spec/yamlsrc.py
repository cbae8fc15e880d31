"""Safe YAML loading that remembers where every key came from.

Spec errors must name ``file:line:key``. PyYAML's safe loader forgets positions once it builds
Python objects, so we compose the node tree ourselves, keep the line of every mapping key and
sequence item (keyed by its path, e.g. ``("rope", "pairing")``), and refuse the YAML features a
spec never needs and an attacker likes: aliases (billion-laughs expansion), custom tags,
non-string keys, nesting deeper than ``MAX_DEPTH`` (PyYAML composes recursively) and integers
longer than ``MAX_INT_DIGITS`` (Python refuses to convert them, and no spec value needs them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MAX_SPEC_BYTES = 256 * 1024
MAX_DEPTH = 32           # a spec nests 4 deep; 1,000 levels would exhaust Python's stack
MAX_INT_DIGITS = 40      # far above any spec value; 4,300+ digits cannot even be converted

KeyPath = tuple[str | int, ...]


class YamlShapeError(ValueError):
    """The text is not a spec-shaped YAML document; carries the 1-based line."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


@dataclass
class LocatedDoc:
    """Plain Python data plus the 1-based line of every key path."""

    data: Any
    lines: dict[KeyPath, int] = field(default_factory=dict)

    def line_of(self, path: KeyPath) -> int:
        """Line of the deepest known prefix of ``path`` (1 when nothing is known)."""
        for end in range(len(path), -1, -1):
            if path[:end] in self.lines:
                return self.lines[path[:end]]
        return 1


class _NoAliasLoader(yaml.SafeLoader):
    depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML signature
        event = self.peek_event()
        if self.check_event(yaml.AliasEvent):
            raise YamlShapeError(event.start_mark.line + 1, "YAML aliases (*name) are not allowed in specs")
        if self.depth >= MAX_DEPTH:
            raise YamlShapeError(event.start_mark.line + 1, f"nested more than {MAX_DEPTH} levels deep")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


_SCALAR_TAGS = {
    "tag:yaml.org,2002:str",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:null",
}


def _to_python(node: yaml.Node, path: KeyPath, doc: LocatedDoc, loader: yaml.SafeLoader) -> Any:
    doc.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                raise YamlShapeError(line, "mapping keys must be plain strings")
            key = key_node.value
            if key in out:
                raise YamlShapeError(line, f"key {key!r} appears twice")
            doc.lines[path + (key,)] = line
            out[key] = _to_python(value_node, path + (key,), doc, loader)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(item, path + (i,), doc, loader) for i, item in enumerate(node.value)]
    if node.tag not in _SCALAR_TAGS:
        raise YamlShapeError(node.start_mark.line + 1, f"unsupported YAML tag {node.tag!r}")
    if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_INT_DIGITS:
        raise YamlShapeError(node.start_mark.line + 1, f"integer of {len(node.value)} characters is out of range "
                                                       f"(at most {MAX_INT_DIGITS})")
    try:
        return loader.construct_object(node, deep=True)
    except ValueError as exc:   # e.g. a float literal Python cannot read
        raise YamlShapeError(node.start_mark.line + 1, f"unreadable value {node.value[:40]!r}: {exc}") from None


def load_located(text: str) -> LocatedDoc:
    """Parse one YAML document into plain data with key lines; raises YamlShapeError."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise YamlShapeError(1, f"spec is larger than {MAX_SPEC_BYTES} bytes")
    loader = None
    try:
        loader = _NoAliasLoader(text)
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise YamlShapeError(line, f"not valid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise YamlShapeError(1, f"not valid YAML: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if node is None:
        raise YamlShapeError(1, "the file is empty; a spec is a YAML mapping")
    if not isinstance(node, yaml.MappingNode):
        raise YamlShapeError(node.start_mark.line + 1, "a spec must be a YAML mapping at the top level")
    doc = LocatedDoc(data=None)
    doc.data = _to_python(node, (), doc, yaml.SafeLoader(""))
    return doc


def read_text(path: Path) -> str:
    """Read a spec file as UTF-8 (size-checked before reading it all)."""
    if path.stat().st_size > MAX_SPEC_BYTES:
        raise YamlShapeError(1, f"spec is larger than {MAX_SPEC_BYTES} bytes")
    return path.read_text(encoding="utf-8")
