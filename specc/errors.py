"""Located errors: every user mistake becomes one line `path:line:col: error: WHAT (HINT)`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Loc:
    """A position in a spec file (1-based line and column), or on the command line."""

    path: str
    line: int = 0
    col: int = 0

    def shifted(self, cols: int) -> "Loc":
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
        where = f"{self.loc}: " if self.loc is not None else ""
        hint = f" ({self.hint})" if self.hint else ""
        return f"{where}error: {self.what}{hint}"

    def __str__(self) -> str:
        return self.format()


def did_you_mean(word: str, choices) -> str:
    """A hint naming the closest valid choice, or listing the valid ones."""
    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if not choices:
        return ""
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"expected one of: {shown}"
