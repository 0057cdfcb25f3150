"""A spec's `${...}` expressions in model.py: an attribute the spec wrote as an expression of its
config (`init_std: ${output_init_std}`, with `output_init_std: ${init_std / sqrt(2 * num_layers)}`)
is emitted as that expression over CONFIG, the config values it names
(`init_std=CONFIG["init_std"] / math.sqrt(2 * CONFIG["num_layers"])`), not as the number it
evaluated to. Config values that are expressions themselves are written out in place, so each
name in CONFIG holds a number the spec (or a --set) gave. The expression is rebuilt from the
same whitelisted syntax tree the frontend evaluated (frontend/expr.py): config names are checked
identifiers and reach the code only as quoted keys; Python computes the same float from it."""

from __future__ import annotations

import ast
import math

from ..errors import Loc, SpecError
from ..frontend.expr import evaluate, parse_python

_MATH = ("sqrt", "ceil", "floor")  # the frontend's functions from `math`
_BUILTIN = ("min", "max", "int")  # and those Python has as builtins
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_MAX_DEPTH = 64  # config values naming config values (the frontend refuses cycles and deeper chains)


class ConfigExprs:
    """Renders attributes' expressions and remembers the config names they use (CONFIG's keys)."""

    def __init__(self, config: dict, config_exprs: dict, builtins: dict):
        self.config, self.config_exprs, self.builtins = config, config_exprs, builtins
        self.used: set = set()
        self.uses_math = False

    def attr(self, op, name: str) -> str | None:
        """Python source of `op`'s attribute `name` over CONFIG, or None when the spec gave it as a
        plain value (or a pass has changed it since the spec's expression was evaluated)."""
        if name not in op.attr_exprs:
            return None
        source, value = op.attr_exprs[name]
        if op.attrs.get(name) != value or type(op.attrs[name]) is not type(self._value(source)):
            return None  # changed since, or converted (an int given to a float attribute): its value
        names, math_used = set(), [False]
        node = self._render(source, names, math_used, 0)
        if node is None or not names:  # a constant expression reads best as its value
            return None
        text = ast.unparse(node)
        if not self._gives(text, value):
            return None
        self.used |= names
        self.uses_math |= math_used[0]
        return text

    def _gives(self, text: str, value) -> bool:
        """True when the generated module computes exactly `value`, type included, from `text`
        (the frontend's arithmetic may keep an int where Python's `/` gives a float: a size must
        stay an int). `text` is built above from whitelisted nodes only: CONFIG lookups, numbers,
        arithmetic and the math functions."""
        scope = {"CONFIG": self.config, "math": math, "min": min, "max": max, "int": int, "__builtins__": {}}
        try:
            got = eval(text, scope)  # our own expression over numbers, see above
        except (ArithmeticError, ValueError, TypeError, RecursionError):
            return False
        return type(got) is type(value) and got == value

    def literal(self) -> dict:
        """CONFIG: the used names with their values, in the spec's config order."""
        return {k: v for k, v in self.config.items() if k in self.used}

    def _value(self, source: str):
        def lookup(name, loc):
            return self.config[name] if name in self.config else self.builtins[name]
        try:
            return evaluate(source, Loc("<config>"), lookup)
        except (SpecError, KeyError):
            return None

    def _render(self, source: str, names: set, math_used: list, depth: int):
        if depth > _MAX_DEPTH:
            return None
        try:
            tree = parse_python(source, "eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        return self._node(tree.body, names, math_used, depth)

    def _node(self, node, names: set, math_used: list, depth: int):
        if isinstance(node, ast.Constant):
            return node if _is_number(node.value) else None
        if isinstance(node, ast.Name):
            if node.id in self.config_exprs:
                return self._render(self.config_exprs[node.id], names, math_used, depth + 1)
            if node.id in self.config:
                if not _is_number(self.config[node.id]):
                    return None
                names.add(node.id)
                return ast.Name(f'CONFIG["{node.id}"]', ast.Load())  # a checked identifier, quoted: atomic
            if node.id in self.builtins and _is_number(self.builtins[node.id]):
                return ast.Constant(self.builtins[node.id])
            return None
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = self._node(node.operand, names, math_used, depth)
            return None if operand is None else ast.UnaryOp(node.op, operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
            left = self._node(node.left, names, math_used, depth)
            right = self._node(node.right, names, math_used, depth)
            return None if left is None or right is None else ast.BinOp(left, node.op, right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords \
                and node.func.id in _MATH + _BUILTIN:
            args = [self._node(a, names, math_used, depth) for a in node.args]
            if any(a is None for a in args):
                return None
            func = ast.Name(node.func.id, ast.Load())
            if node.func.id in _MATH:
                math_used[0] = True
                func = ast.Attribute(ast.Name("math", ast.Load()), node.func.id, ast.Load())
            return ast.Call(func, args, [])
        return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float))  # bool included: a setting such as sequence_parallel
