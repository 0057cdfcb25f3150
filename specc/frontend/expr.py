"""`${...}` interpolation: config names and small, safe arithmetic.

Expressions are parsed with Python's `ast` and evaluated by walking a whitelist of node types,
never with eval(): spec text cannot run code.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import warnings

from ..errors import Loc, SpecError, did_you_mean

_INTERP = re.compile(r"\$\{([^{}]*)\}")
_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_FUNCS = {"min": min, "max": max, "sqrt": math.sqrt, "int": int, "ceil": math.ceil, "floor": math.floor}
MAX_EXPONENT = 64  # keeps `${10 ** 10 ** 10}` from hanging the compiler
MAX_MAGNITUDE = 10 ** 30  # no size is larger; bigger numbers only come from mistakes
HINT = "use config names, numbers, + - * / // % **, min, max, sqrt, int, ceil, floor"


def has_interpolation(text: str) -> bool:
    return "${" in text


def whole_expression(text) -> str | None:
    """The source inside a text that is one whole `${expr}` (whose value is the expression's, a
    number staying a number), else None."""
    if not isinstance(text, str):
        return None
    whole = _INTERP.fullmatch(text.strip())
    return whole.group(1).strip() if whole else None


def interpolate(text: str, loc: Loc, lookup):
    """Evaluate every `${expr}` in text. A string that is one whole `${expr}` yields its value
    (a number stays a number); otherwise the parts are formatted into a string."""
    if text.count("${") != len(_INTERP.findall(text)):
        _unbalanced(text, loc)
    whole = _INTERP.fullmatch(text.strip())
    if whole:
        start = text.find("${") + 2
        return evaluate(whole.group(1), loc.shifted(start), lookup)

    def repl(m):
        return _format(evaluate(m.group(1), loc.shifted(m.start(1)), lookup))

    return _INTERP.sub(repl, text)


def _unbalanced(text: str, loc: Loc):
    """Locate the first `${` that does not close before another `${` or the end of the text."""
    at = 0
    while True:
        col = text.find("${", at)
        if col < 0:
            return
        close, nested = text.find("}", col + 2), text.find("${", col + 2)
        if close < 0:
            raise SpecError(loc.shifted(col), "unterminated '${' in interpolation", "close it with '}': ${name}")
        if 0 <= nested < close or "{" in text[col + 2:close]:
            inner = nested if nested >= 0 else text.find("{", col + 2)
            raise SpecError(loc.shifted(inner), "nested braces inside '${...}'",
                            "an interpolation holds one expression over config names: ${a * b}")
        at = close + 1


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def evaluate(source: str, loc: Loc, lookup):
    """Evaluate one expression; `lookup(name, loc)` returns a config value or raises SpecError."""
    if not source.strip():
        raise SpecError(loc, "empty interpolation '${}'", "write ${name} or ${expression}")
    lead = len(source) - len(source.lstrip())
    text = source.strip()
    try:
        tree = parse_python(text, "eval")
    except SyntaxError as e:
        raise SpecError(loc.shifted(lead + error_col(text, e)), f"bad expression '{text}': {syntax_message(e)}", HINT) from None
    except ValueError as e:  # e.g. a NUL character
        raise SpecError(loc.shifted(lead), f"bad expression '{text}': {e}", HINT) from None
    except (RecursionError, MemoryError):
        raise SpecError(loc.shifted(lead), "expression is nested too deeply", "split it into several config values") from None
    try:
        return _Eval(loc.shifted(lead), lookup, text).visit(tree.body)
    except RecursionError:
        raise SpecError(loc.shifted(lead), "expression is nested too deeply", "split it into several config values") from None


def parse_python(text: str, mode: str):
    """`ast.parse`, silently: Python warns on stderr about text such as `1if x` and a spec's
    errors must stay one line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(text, mode=mode)


def syntax_message(e: SyntaxError) -> str:
    """Python's message, without its advice about Python itself."""
    return (e.msg or "invalid syntax").splitlines()[0].split(" - ")[0].split("; use ")[0]


def char_col(text: str, node) -> int:
    """Offset in `text` of an `ast` node, which counts lines and UTF-8 bytes within its line."""
    lines = text.split("\n")
    lineno = min(max(getattr(node, "lineno", 1) or 1, 1), len(lines))
    offset = getattr(node, "col_offset", 0) or 0
    before = sum(len(ln) + 1 for ln in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode("utf-8")[:offset].decode("utf-8", "ignore"))


def error_col(text: str, e: SyntaxError) -> int:
    """Offset in `text` of a SyntaxError (whose line is 1-based and column is 1-based characters)."""
    lines = text.split("\n")
    lineno = min(max(e.lineno or 1, 1), len(lines))
    before = sum(len(ln) + 1 for ln in lines[: lineno - 1])
    return min(before + max((e.offset or 1) - 1, 0), len(text))


class _Eval:
    def __init__(self, loc: Loc, lookup, text: str):
        self.loc = loc
        self.lookup = lookup
        self.text = text

    def at(self, node) -> Loc:
        return self.loc.shifted(char_col(self.text, node))

    def visit(self, node):
        value = self._visit(node)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > MAX_MAGNITUDE \
                and not (isinstance(value, float) and math.isinf(value)):
            raise SpecError(self.at(node), f"'{_short(node)}' is too large (more than 1e30)", "check the expression")
        return value

    def _visit(self, node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            return self.lookup(node.id, self.at(node))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = self._number(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return self._binop(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
            args = [self._number(a) for a in node.args]
            try:
                return _FUNCS[node.func.id](*args)
            except (TypeError, ValueError, OverflowError) as e:
                raise SpecError(self.at(node), f"bad call {node.func.id}(): {e}") from None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in _FUNCS:
            raise SpecError(self.at(node), f"unknown function '{node.func.id}'", did_you_mean(node.func.id, _FUNCS))
        raise SpecError(self.at(node), f"unsupported expression '{_short(node)}'", HINT)

    def _number(self, node):
        value = self.visit(node)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SpecError(self.at(node), f"'{_short(node)}' is not a number, but {_what(value)}",
                            "arithmetic works on numbers only")
        return value

    def _binop(self, node):
        left, right = self._number(node.left), self._number(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise SpecError(self.at(node), f"division by zero in '{_short(node)}'", f"'{_short(node.right)}' is 0")
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise SpecError(self.at(node), f"exponent {right:g} is too large (at most {MAX_EXPONENT})")
        try:
            value = _BINOPS[type(node.op)](left, right)
        except (OverflowError, ValueError, ZeroDivisionError, TypeError) as e:
            raise SpecError(self.at(node), f"cannot compute '{_short(node)}': {e}") from None
        if isinstance(value, complex):
            raise SpecError(self.at(node), f"cannot compute '{_short(node)}': the result is not a real number")
        return value


def _short(node) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _what(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return f"the string '{value[:40]}'"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def unknown_name(name: str, loc: Loc, known) -> SpecError:
    return SpecError(loc, f"undefined interpolation variable '{name}'", did_you_mean(name, known))
