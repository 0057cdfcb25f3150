"""Parse forward steps such as `h = h + attention(norm1(h))` into Expr trees, with columns.

Steps are parsed with Python's `ast` and only a tiny subset is accepted: names, calls of
submodules, `+` and `*`. Nothing from a spec is ever pasted into generated code as text."""

from __future__ import annotations

import ast
import keyword

from ..errors import Loc, SpecError
from .model import Expr, Step

# names the generated code uses itself; a spec variable may not shadow them
RESERVED = frozenset({"self", "torch", "runtime", "mappings", "nn", "rng_tracker", "pg", "tp", "super", "range",
                      "len", "tuple", "list", "dict", "int", "float", "print", "layer", "CONFIG", "SETTINGS"})


def check_identifier(name, loc: Loc, what: str) -> None:
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        raise SpecError(loc, f"{what} {name!r} is not a valid Python identifier",
                        "use letters, digits and underscores, not starting with a digit")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise SpecError(loc, f"{what} '{name}' is a Python keyword", f"rename it, e.g. '{name}_'")
    if name in RESERVED:
        raise SpecError(loc, f"{what} '{name}' is reserved in generated code", f"rename it, e.g. '{name}_'")


def parse_step(text, loc: Loc) -> Step:
    if not isinstance(text, str):
        raise SpecError(loc, f"a forward step must be a string like 'y = f(x)', got {type(text).__name__}")
    col0 = 1 if getattr(text, "quoted", False) else 0
    base = loc.shifted(col0)
    stripped = text.strip()
    lead = len(text) - len(text.lstrip())
    if stripped.startswith("return"):
        rest = stripped[len("return"):]
        if rest and not rest[0].isspace():
            raise SpecError(base.shifted(lead), f"bad step '{stripped}'", "write 'return NAME' or 'return a, b'")
        node = _parse(rest.strip(), base.shifted(lead + len(stripped) - len(rest.strip())))
        at = base.shifted(lead + len(stripped) - len(rest.strip()))
        names = node.elts if isinstance(node, ast.Tuple) else [node]
        returns = []
        for n in names:
            if not isinstance(n, ast.Name):
                raise SpecError(at.shifted(getattr(n, "col_offset", 0)), "return takes variable names only",
                                "assign the expression to a name first")
            returns.append(n.id)
        return Step([], None, returns, stripped, base.shifted(lead))
    try:
        tree = ast.parse(stripped, mode="exec")
    except SyntaxError as e:
        raise SpecError(base.shifted(lead + max((e.offset or 1) - 1, 0)), f"bad step '{stripped}': {e.msg}",
                        "write 'y = f(x)', 'y = a + b' or 'return y'") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign) or len(tree.body[0].targets) != 1:
        raise SpecError(base.shifted(lead), f"bad step '{stripped}'", "write 'y = f(x)', 'y = a + b' or 'return y'")
    assign = tree.body[0]
    target = assign.targets[0]
    names = target.elts if isinstance(target, ast.Tuple) else [target]
    targets = []
    for n in names:
        where = base.shifted(lead + getattr(n, "col_offset", 0))
        if not isinstance(n, ast.Name):
            raise SpecError(where, "only plain names can be assigned")
        check_identifier(n.id, where, "variable")
        targets.append(n.id)
    if len(set(targets)) != len(targets):
        raise SpecError(base.shifted(lead), f"a name is assigned twice in '{stripped}'")
    expr = _expr(assign.value, base.shifted(lead))
    return Step(targets, expr, [], stripped, base.shifted(lead))


def _parse(source: str, loc: Loc):
    if not source:
        raise SpecError(loc, "return needs a value", "write 'return y'")
    try:
        return ast.parse(source, mode="eval").body
    except SyntaxError as e:
        raise SpecError(loc.shifted(max((e.offset or 1) - 1, 0)), f"bad return value '{source}': {e.msg}") from None


def _expr(node, base: Loc) -> Expr:
    at = base.shifted(getattr(node, "col_offset", 0))
    if isinstance(node, ast.Name):
        return Expr("var", at, name=node.id)
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            raise SpecError(at, "only submodules can be called, by their plain name")
        if node.keywords:
            raise SpecError(at, "keyword arguments are not supported in forward steps")
        args = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                raise SpecError(base.shifted(a.col_offset), "starred arguments are not supported")
            args.append(_expr(a, base))
        return Expr("call", base.shifted(node.func.col_offset), name=node.func.id, args=args)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        kind = "add" if isinstance(node.op, ast.Add) else "mul"
        left, right = _expr(node.left, base), _expr(node.right, base)
        args = []
        for side in (left, right):  # a + b + c is one n-ary sum, so partial sums can meet first
            args.extend(side.args if kind == "add" and side.kind == "add" else [side])
        return Expr(kind, at, args=args)
    raise SpecError(at, f"unsupported expression '{ast.unparse(node)}' in a forward step",
                    "use names, submodule calls, + and *")
