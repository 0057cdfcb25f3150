"""Read YAML into located values, safely.

PyYAML's composer keeps a mark (line, column) on every node and does not expand aliases, so a
document is read in memory bounded by its size; we expand it ourselves under a node budget, which
refuses alias bombs ("billion laughs") quickly instead of exhausting memory.
"""

from __future__ import annotations

import yaml

from ..errors import Loc, SpecError, did_you_mean

MAX_BYTES = 1 << 20  # a spec is a page of text; a megabyte is already absurd
MAX_NODES = 200_000  # values after alias expansion
MAX_DEPTH = 64  # nesting of mappings and sequences
MAX_CHARS = 8 << 20  # characters of scalar text after alias expansion
_PLAIN_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


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
    """A string scalar that remembers where its text is in the file, so that a character inside
    its value can be located even where the source differs (quotes, escapes, folded lines)."""

    loc: Loc
    quoted: bool
    _src: tuple  # (buffer, start index, end index, style) of the scalar's source text
    _offsets: list | None = None

    def loc_at(self, offset: int) -> Loc:
        """The location of character `offset` of the value; further `shifted` calls stay exact."""
        offsets = self._offsets
        if offsets is None:
            offsets = self._offsets = _align(self, *self._src)
        if not offsets:  # source unknown: count from the start, past an opening quote
            base = Loc(self.loc.path, self.loc.line, self.loc.col + (1 if self.quoted else 0) + offset)
            return Loc(base.path, base.line, base.col, (self, offset))
        buffer, start = self._src[0], self._src[1]
        q = offsets[min(max(offset, 0), len(offsets) - 1)] + max(offset - (len(offsets) - 1), 0)
        line, col = self.loc.line, self.loc.col + q
        nl = buffer.rfind("\n", start, start + q)
        if nl >= 0:
            line += buffer.count("\n", start, start + q)
            col = start + q - nl
        return Loc(self.loc.path, line, col, (self, offset))


def _align(value: str, buffer, start: int, end: int, style) -> list:
    """Source offset (from the scalar's first character) of each character of its value, and of
    its end. Plain and quoted scalars differ from their value only by quotes, escapes and line
    folding, so walking both texts side by side finds every character."""
    if buffer is None:
        return []
    src = buffer[start:end]
    p = 0
    if style in ("'", '"'):
        p = 1
    elif style in ("|", ">"):
        p = src.find("\n") + 1  # content starts after the header line (which may hold a comment)
    out = []
    for ch in value:
        if style == '"' and src.startswith("\\", p) and p + 1 < len(src) and src[p + 1] not in "\r\n":
            out.append(p)  # one escape: \t, \", \\, \xXX, \uXXXX, \UXXXXXXXX
            p += {"x": 4, "u": 6, "U": 10}.get(src[p + 1], 2)
            continue
        q = src.find(ch, p)
        if q < 0:
            out.append(p)
            continue
        out.append(q)
        p = q + 1
    out.append(p)
    return out


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
        at = data.index(b"\x00")
        line, col = data.count(b"\n", 0, at) + 1, at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise SpecError(Loc(path, line, col), "file is binary (it contains NUL bytes), not a YAML spec",
                        "a spec is a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise SpecError(Loc(path, line, col), "file is not valid UTF-8", "save the spec as UTF-8") from None


_COMPOSED: dict = {}  # text -> yaml's node tree, for texts of at most _CACHED_BYTES
_CACHED_BYTES = 1 << 16


def _compose(text: str):
    """yaml.compose's node tree of `text`, parsed once per process (the converter only reads it):
    a spec and the specs it extends are read again by every command, compile and hint."""
    node = _COMPOSED.get(text)
    if node is None:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if len(text) <= _CACHED_BYTES and len(_COMPOSED) < 1024:
            _COMPOSED[text] = node
    return node


def load_yaml(text: str, path: str):
    """Parse one YAML document into LDict/LList/scalars with locations."""
    hint = "a spec is a YAML mapping with at least 'name', 'model' and 'modules'"
    if not text.strip():
        raise SpecError(Loc(path, 1, 1), "file is empty", hint)
    if all(not ln.strip() or ln.lstrip().startswith("#") for ln in text.splitlines()):
        raise SpecError(Loc(path, 1, 1), "file holds only comments", hint)
    try:
        node = _compose(text)
    except yaml.MarkedYAMLError as e:
        raise _syntax_error(e, path) from None
    except yaml.reader.ReaderError as e:  # a control character: locate it in the text
        at = min(e.position, len(text))
        line, col = text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1
        code = e.character if isinstance(e.character, int) else ord(str(e.character)[:1] or "?")
        raise SpecError(Loc(path, line, col), f"YAML syntax error: character U+{code:04X} is not allowed",
                        "remove the control character") from None
    except yaml.YAMLError as e:
        raise SpecError(Loc(path, 1, 1), "YAML error: " + " ".join(str(e).split())) from None
    except RecursionError:
        raise SpecError(Loc(path, 1, 1), f"document is nested too deeply (more than {MAX_DEPTH} levels)") from None
    if node is None:
        raise SpecError(Loc(path, 1, 1), "file holds no YAML value", hint)
    _check_expanded_size(node, path)
    return _Converter(path).convert(node, 0)


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expanded_size(root, path: str) -> None:
    """Refuse alias bombs before building anything. An alias is the very node it names, so the
    expanded size of every node is computed once, in time and memory linear in the file."""
    sizes: dict = {}  # id(node) -> (values, characters) after expansion
    active: set = set()  # nodes being measured: meeting one again is an alias inside its own anchor

    def size(node, depth: int):
        if id(node) in sizes:
            return sizes[id(node)]
        loc = _mark_loc(path, node.start_mark)
        if id(node) in active:
            raise SpecError(loc, "an alias refers to a value that contains it", "a spec cannot be recursive")
        if depth > MAX_DEPTH:
            raise SpecError(loc, f"document is nested too deeply (more than {MAX_DEPTH} levels)")
        active.add(id(node))
        values, chars = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
        for child in _children(node):
            v, c = size(child, depth + 1)
            values, chars = values + v, chars + c
        active.discard(id(node))
        sizes[id(node)] = (values, chars)
        return values, chars

    values, chars = size(root, 0)
    if values <= MAX_NODES and chars <= MAX_CHARS:
        return
    over = (lambda n: sizes[id(n)][0] > MAX_NODES) if values > MAX_NODES else (lambda n: sizes[id(n)][1] > MAX_CHARS)
    node = root
    while True:  # blame the smallest value that is too big by itself
        bigger = next((c for c in _children(node) if over(c)), None)
        if bigger is None:
            break
        node = bigger
    what = f"{MAX_NODES} values" if values > MAX_NODES else f"{MAX_CHARS} characters of text"
    raise SpecError(_mark_loc(path, node.start_mark), f"this value expands to more than {what}",
                    "anchors and aliases may not multiply a spec's size")


def _syntax_error(e, path: str) -> SpecError:
    """PyYAML's problem, at its mark; its context (what it was reading, where that started) as the hint."""
    mark = e.problem_mark or e.context_mark
    loc = _mark_loc(path, mark) if mark else Loc(path)
    problem = (e.problem or "invalid YAML").strip()
    context = (e.context or "").strip() if e.problem else ""
    hint = ""
    if "'\\t'" in problem:
        hint = "indent with spaces: YAML does not allow tabs here"
    elif problem.startswith("but ") and context:  # "expected a single document in the stream, but found another"
        problem, context = f"{context}, {problem}", ""
        hint = "a spec is one YAML document; remove the '---' line"
    if context and not hint:
        cm = e.context_mark
        same = cm is not None and mark is not None and (cm.line, cm.column) == (mark.line, mark.column)
        hint = context if cm is None or same else f"{context} at line {cm.line + 1}, column {cm.column + 1}"
    return SpecError(loc, f"YAML syntax error: {problem}", hint)


class _Converter:
    def __init__(self, path: str):
        self.path = path
        self.nodes = 0
        self.chars = 0
        self.scalars: dict = {}  # id(node) -> converted scalar: an alias shares its anchor's value
        self.constructor = yaml.constructor.SafeConstructor()

    def convert(self, node, depth: int):
        loc = _mark_loc(self.path, node.start_mark)
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SpecError(loc, f"document expands to more than {MAX_NODES} values",
                            "anchors and aliases may not multiply a spec's size")
        if depth > MAX_DEPTH:
            raise SpecError(loc, f"document is nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and node.tag not in _PLAIN_TAGS:
            raise SpecError(loc, f"unsupported YAML tag '{node.tag}'",
                            "specs use plain strings, numbers, booleans, lists and mappings, without tags")
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
                shown = {True: "true", False: "false", None: "null"}.get(key, key) if not isinstance(key, float) else key
                raise SpecError(kloc, f"mapping key {shown} must be a string", "quote it, or use a name")
            if key in out:
                raise SpecError(kloc, f"duplicate key '{key}'", f"first defined at line {out.key_locs[key].line}")
            out[key] = self.convert(vnode, depth + 1)
            out.key_locs[key] = kloc
            out.value_locs[key] = _mark_loc(self.path, vnode.start_mark)
        return out

    def _scalar(self, node, loc: Loc):
        if not isinstance(node, yaml.ScalarNode):
            raise SpecError(loc, "expected a scalar")
        self.chars += len(node.value)
        if self.chars > MAX_CHARS:
            raise SpecError(loc, f"document expands to more than {MAX_CHARS} characters of text",
                            "anchors and aliases may not multiply a spec's size")
        if id(node) in self.scalars:
            return self.scalars[id(node)]
        try:
            value = self.constructor.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError:
            raise SpecError(loc, f"unsupported YAML tag '{node.tag}'",
                            "specs use plain strings, numbers, booleans, lists and mappings, without tags") from None
        except yaml.YAMLError as e:
            raise SpecError(loc, f"bad scalar: {getattr(e, 'problem', e)}") from None
        except (ValueError, OverflowError) as e:  # e.g. an out-of-range !!timestamp
            raise SpecError(loc, f"bad scalar '{node.value[:40]}': {e}") from None
        if isinstance(value, str):
            s = LStr(value)
            s.loc, s.quoted = loc, node.style in ("'", '"')
            s._src = (node.start_mark.buffer, node.start_mark.index, node.end_mark.index, node.style)
            self.scalars[id(node)] = s
            return s
        if isinstance(value, (bool, int, float)) or value is None:
            return value
        raise SpecError(loc, f"unsupported YAML value of type {type(value).__name__}",
                        "quote it if it is meant as a string" if node.tag.endswith(("timestamp", "binary"))
                        else "use strings, numbers, booleans, lists and mappings")


# -- describing a spec's values in its errors ------------------------------------------------

def clip(text, n: int = 40) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 3] + "..."


def kind_of(v) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if v is None:
        return "nothing (null)"
    return {int: "an integer", float: "a number", str: "a string", LStr: "a string", list: "a list", LList: "a list",
            dict: "a mapping", LDict: "a mapping"}.get(type(v), type(v).__name__)


def check_keys(d: LDict, allowed, where: str) -> None:
    for key in d:
        if key not in allowed:
            raise SpecError(d.key_loc(key), f"unknown key '{key}' {where}", did_you_mean(key, allowed))
