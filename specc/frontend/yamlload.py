"""Read YAML into located values, safely.

PyYAML's composer keeps a mark (line, column) on every node and does not expand aliases, so a
document is read in memory bounded by its size; we expand it ourselves under a node budget, which
refuses alias bombs ("billion laughs") quickly instead of exhausting memory.
"""

from __future__ import annotations

import yaml

from ..errors import Loc, SpecError

MAX_BYTES = 1 << 20  # a spec is a page of text; a megabyte is already absurd
MAX_NODES = 200_000  # values after alias expansion
MAX_DEPTH = 64  # nesting of mappings and sequences


class LDict(dict):
    """A mapping that remembers where it, each key, and each value came from."""

    loc: Loc
    key_locs: dict
    value_locs: dict

    def key_loc(self, key) -> Loc:
        return self.key_locs.get(key, self.loc)

    def value_loc(self, key) -> Loc:
        return self.value_locs.get(key, self.loc)


class LList(list):
    """A sequence that remembers where it and each item came from."""

    loc: Loc
    item_locs: list

    def item_loc(self, i: int) -> Loc:
        return self.item_locs[i] if i < len(self.item_locs) else self.loc


class LStr(str):
    """A string scalar that remembers where its text starts (for locating parts of it)."""

    loc: Loc
    quoted: bool


def _mark_loc(path: str, mark) -> Loc:
    return Loc(path, mark.line + 1, mark.column + 1)


def read_text(path: str) -> str:
    """Read a spec file as UTF-8 text, refusing what is not a text spec."""
    loc = Loc(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(loc, "no such file", "check the path") from None
    except IsADirectoryError:
        raise SpecError(loc, "is a directory, not a spec file") from None
    except OSError as e:
        raise SpecError(loc, f"cannot read file: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise SpecError(loc, f"file is larger than {MAX_BYTES} bytes", "a spec is a short text file")
    if b"\x00" in data:
        raise SpecError(loc, "file is binary, not a YAML spec")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise SpecError(Loc(path, line, col), "file is not valid UTF-8", "save the spec as UTF-8") from None


def load_yaml(text: str, path: str):
    """Parse one YAML document into LDict/LList/scalars with locations."""
    if not text.strip() or all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise SpecError(Loc(path, 1, 1), "file is empty", "a spec is a YAML mapping with at least 'modules' and 'model'")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = _mark_loc(path, mark) if mark else Loc(path)
        problem = (e.problem or e.context or "invalid YAML").strip()
        raise SpecError(loc, f"YAML syntax error: {problem}") from None
    except yaml.YAMLError as e:
        raise SpecError(Loc(path, 1, 1), f"YAML error: {e}") from None
    except RecursionError:
        raise SpecError(Loc(path, 1, 1), f"document is nested too deeply (more than {MAX_DEPTH} levels)") from None
    if node is None:
        raise SpecError(Loc(path, 1, 1), "file is empty")
    return _Converter(path).convert(node, 0)


class _Converter:
    def __init__(self, path: str):
        self.path = path
        self.nodes = 0
        self.constructor = yaml.constructor.SafeConstructor()

    def convert(self, node, depth: int):
        loc = _mark_loc(self.path, node.start_mark)
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SpecError(loc, f"document expands to more than {MAX_NODES} values",
                            "anchors and aliases may not multiply a spec's size")
        if depth > MAX_DEPTH:
            raise SpecError(loc, f"document is nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, loc, depth)
        if isinstance(node, yaml.SequenceNode):
            out = LList()
            out.loc, out.item_locs = loc, []
            for item in node.value:
                out.append(self.convert(item, depth + 1))
                out.item_locs.append(_mark_loc(self.path, item.start_mark))
            return out
        return self._scalar(node, loc)

    def _mapping(self, node, loc: Loc, depth: int) -> LDict:
        out = LDict()
        out.loc, out.key_locs, out.value_locs = loc, {}, {}
        for knode, vnode in node.value:
            kloc = _mark_loc(self.path, knode.start_mark)
            if knode.tag == "tag:yaml.org,2002:merge":
                raise SpecError(kloc, "YAML merge keys ('<<') are not supported", "use 'extends' to reuse a spec")
            if not isinstance(knode, yaml.ScalarNode):
                raise SpecError(kloc, "mapping keys must be plain strings")
            key = self._scalar(knode, kloc)
            if not isinstance(key, str):
                raise SpecError(kloc, f"mapping key {key!r} must be a string", "quote it")
            if key in out:
                raise SpecError(kloc, f"duplicate key '{key}'", f"first defined at line {out.key_locs[key].line}")
            out[key] = self.convert(vnode, depth + 1)
            out.key_locs[key] = kloc
            out.value_locs[key] = _mark_loc(self.path, vnode.start_mark)
        return out

    def _scalar(self, node, loc: Loc):
        if not isinstance(node, yaml.ScalarNode):
            raise SpecError(loc, "expected a scalar")
        try:
            value = self.constructor.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            raise SpecError(loc, f"bad scalar: {getattr(e, 'problem', e)}") from None
        if isinstance(value, str):
            s = LStr(value)
            s.loc, s.quoted = loc, node.style in ("'", '"')
            return s
        if isinstance(value, (bool, int, float)) or value is None:
            return value
        raise SpecError(loc, f"unsupported YAML value of type {type(value).__name__}",
                        "use strings, numbers, booleans, lists and mappings")
