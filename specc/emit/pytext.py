"""Spec text in generated Python: only ever as a string literal or docstring that no input can
end early. Plain ASCII text comes out as written; everything else is escaped, so model.py is
pure ASCII (the same bytes whatever the locale or the Python version's Unicode tables)."""

from __future__ import annotations

_NAMED = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _char(c: str) -> str:
    if c in _NAMED:
        return _NAMED[c]
    o = ord(c)
    if 0x20 <= o < 0x7F:
        return c
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def string_literal(text: str) -> str:
    """A double-quoted Python string literal whose value is exactly `text`."""
    return '"' + "".join('\\"' if c == '"' else _char(c) for c in str(text)) + '"'


def docstring_text(text: str) -> str:
    """`text` for the inside of a triple-double-quoted docstring: its value is exactly `text`.
    Line breaks stay line breaks; a quote is escaped only where it would meet another quote or
    the closing quotes, and a backslash is doubled, so nothing can close the docstring early."""
    text = str(text)
    out = []
    for i, c in enumerate(text):
        if c == '"':
            out.append('\\"' if i + 1 == len(text) or text[i + 1] == '"' else '"')
        elif c == "\n":
            out.append(c)
        else:
            out.append(_char(c))
    return "".join(out)
