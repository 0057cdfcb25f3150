"""`${...}` interpolation: config names and small, safe arithmetic.

Expressions are parsed with Python's `ast` and evaluated by walking a whitelist of node types,
never with eval(): spec text cannot run code.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from ..errors import Loc, SpecError, did_you_mean

_INTERP = re.compile(r"\$\{([^{}]*)\}")
_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_FUNCS = {"min": min, "max": max, "sqrt": math.sqrt, "int": int, "ceil": math.ceil, "floor": math.floor}
MAX_EXPONENT = 64  # keeps `${10 ** 10 ** 10}` from hanging the compiler


def has_interpolation(text: str) -> bool:
    return "${" in text


def interpolate(text: str, loc: Loc, lookup):
    """Evaluate every `${expr}` in text. A string that is one whole `${expr}` yields its value
    (a number stays a number); otherwise the parts are formatted into a string."""
    if text.count("${") != len(_INTERP.findall(text)):
        col = text.find("${")
        raise SpecError(loc.shifted(col), "unterminated or nested '${' in interpolation", "write ${name} or ${expression}")
    whole = _INTERP.fullmatch(text.strip())
    if whole:
        start = text.find("${") + 2
        return evaluate(whole.group(1), loc.shifted(start), lookup)

    def repl(m):
        return _format(evaluate(m.group(1), loc.shifted(m.start(1)), lookup))

    return _INTERP.sub(repl, text)


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def evaluate(source: str, loc: Loc, lookup):
    """Evaluate one expression; `lookup(name, loc)` returns a config value or raises SpecError."""
    if not source.strip():
        raise SpecError(loc, "empty interpolation '${}'", "write ${name} or ${expression}")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as e:
        raise SpecError(loc.shifted(max((e.offset or 1) - 1, 0)), f"bad expression '{source.strip()}': {e.msg}") from None
    lead = len(source) - len(source.lstrip())
    return _Eval(loc.shifted(lead), lookup).visit(tree.body)


class _Eval:
    def __init__(self, loc: Loc, lookup):
        self.loc = loc
        self.lookup = lookup

    def at(self, node) -> Loc:
        return self.loc.shifted(getattr(node, "col_offset", 0))

    def visit(self, node):
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
            except (TypeError, ValueError) as e:
                raise SpecError(self.at(node), f"bad call {node.func.id}(): {e}") from None
        raise SpecError(self.at(node), f"unsupported expression '{ast.unparse(node)}'",
                        "use config names, numbers, + - * / // % **, min, max, sqrt, int, ceil, floor")

    def _number(self, node):
        value = self.visit(node)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SpecError(self.at(node), f"'{ast.unparse(node)}' is not a number")
        return value

    def _binop(self, node):
        left, right = self._number(node.left), self._number(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise SpecError(self.at(node), f"division by zero in '{ast.unparse(node)}'")
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise SpecError(self.at(node), f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            return _BINOPS[type(node.op)](left, right)
        except (OverflowError, ValueError, ZeroDivisionError) as e:
            raise SpecError(self.at(node), f"cannot compute '{ast.unparse(node)}': {e}") from None


def unknown_name(name: str, loc: Loc, known) -> SpecError:
    return SpecError(loc, f"undefined interpolation variable '{name}'", did_you_mean(name, known))
