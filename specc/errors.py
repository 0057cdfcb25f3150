"""Located errors: every user mistake becomes one line `path:line:col: error: WHAT (HINT)`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Loc:
    """A position in a spec file (1-based line and column), or on the command line.

    A Loc made for a string scalar also remembers the scalar (`anchor`: the scalar and an offset
    into its value), so that `shifted` can find the source position of a character inside a
    value even where the source differs from the value: escapes in quoted strings, folded lines,
    block scalars."""

    path: str
    line: int = 0
    col: int = 0
    anchor: tuple | None = field(default=None, compare=False, repr=False)

    def shifted(self, cols: int) -> "Loc":
        if self.anchor is not None:
            scalar, offset = self.anchor
            return scalar.loc_at(offset + cols)
        return Loc(self.path, self.line, self.col + cols)

    def __str__(self) -> str:
        if self.line <= 0:
            return self.path
        return f"{self.path}:{self.line}:{self.col}"


class SpecError(Exception):
    """A mistake in user input, reported without a traceback."""

    def __init__(self, loc: Loc | None, what: str, hint: str = ""):
        super().__init__(what)
        self.loc = loc
        self.what = what
        self.hint = hint

    def format(self) -> str:
        """One line, whatever the spec held: control characters and line breaks are escaped."""
        where = f"{self.loc}: " if self.loc is not None else ""
        hint = f" ({self.hint})" if self.hint else ""
        return _one_line(f"{where}error: {self.what}{hint}")

    def __str__(self) -> str:
        return self.format()


def _one_line(text: str) -> str:
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def did_you_mean(word, choices, listed: bool = False) -> str:
    """A hint naming the closest valid choice, or listing the valid ones (nothing when the message
    already lists them: `listed`)."""
    choices = sorted(str(c) for c in choices)
    word = str(word)
    same_case = [c for c in choices if c.lower() == word.lower()]
    close = same_case or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if not choices or listed:
        return ""
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"expected one of: {shown}"
