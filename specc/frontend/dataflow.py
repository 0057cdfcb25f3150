"""Parse forward steps such as `h = h + attention(norm1(h))` into Expr trees, with columns.

Steps are parsed with Python's `ast` and only a tiny subset is accepted: names, calls of
submodules, `+` and `*`. Nothing from a spec is ever pasted into generated code as text."""

from __future__ import annotations

import ast
import keyword
import re

from ..errors import Loc, SpecError
from .expr import char_col, error_col, parse_python, syntax_message
from .model import Expr, Step

# names the generated code uses itself; a spec variable may not shadow them
RESERVED = frozenset({"self", "math", "torch", "runtime", "mappings", "nn", "rng_tracker", "pg", "tp", "super", "range",
                      "len", "tuple", "list", "dict", "int", "float", "print", "layer", "CONFIG", "SETTINGS",
                      "ValueError"})
# what the generated module defines at its top level: no spec name may replace (or shadow) it
MODULE_GLOBALS = frozenset({"SPEC_NAME", "SPEC_SHA256", "SETTINGS", "COMPILE_COMMAND", "build_model"})
# what every generated class has from torch.nn.Module (torch 2.x); a submodule is an attribute of
# its class, so it may not replace one of these (names starting with '__' are refused for all)
NN_MODULE_ATTRS = frozenset({
    "T_destination", "_apply", "_backward_hooks", "_backward_pre_hooks", "_buffers",
    "_call_impl", "_compiled_call_impl", "_forward_hooks", "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_get_backward_hooks",
    "_get_backward_pre_hooks", "_get_name", "_is_full_backward_hook", "_load_from_state_dict",
    "_load_state_dict_post_hooks", "_load_state_dict_pre_hooks", "_maybe_warn_non_full_backward_hook", "_modules",
    "_named_members", "_non_persistent_buffers_set", "_parameters", "_register_load_state_dict_pre_hook",
    "_register_state_dict_hook", "_replicate_for_data_parallel", "_save_to_state_dict", "_slow_forward",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_version", "_wrapped_call_impl", "add_module", "apply", "bfloat16",
    "buffers", "call_super_init", "children", "compile", "cpu", "cuda", "double", "dump_patches", "eval",
    "extra_repr", "float", "forward", "get_buffer", "get_extra_state", "get_parameter", "get_submodule", "half",
    "ipu", "load_state_dict", "modules", "mtia", "named_buffers", "named_children", "named_modules",
    "named_parameters", "parameters", "register_backward_hook", "register_buffer", "register_forward_hook",
    "register_forward_pre_hook", "register_full_backward_hook", "register_full_backward_pre_hook",
    "register_load_state_dict_post_hook", "register_load_state_dict_pre_hook", "register_module",
    "register_parameter", "register_state_dict_post_hook", "register_state_dict_pre_hook", "requires_grad_",
    "set_extra_state", "set_submodule", "share_memory", "state_dict", "to", "to_empty", "train", "training", "type",
    "xpu", "zero_grad"})
STEP_HINT = "write 'y = f(x)', 'y = a + b' or 'return y'"
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_identifier(name, loc: Loc, what: str) -> None:
    if not isinstance(name, str) or not name.isidentifier() or not name.isascii():
        raise SpecError(loc, f"{what} {_show(name)} is not a valid Python identifier",
                        "use ASCII letters, digits and underscores, not starting with a digit")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        raise SpecError(loc, f"{what} '{name}' is a Python keyword", f"rename it, e.g. '{name}_'")
    if name in RESERVED:
        raise SpecError(loc, f"{what} '{name}' is reserved in generated code", f"rename it, e.g. '{name}_'")
    why = ("Python gives names that start with '__' a special meaning"
           if name.startswith("__") else "the generated module defines it" if name in MODULE_GLOBALS
           else "every torch.nn.Module has it" if what == "submodule name" and name in NN_MODULE_ATTRS else "")
    if why:
        plain = name.strip("_")
        other = f"{plain}_" if plain and not plain[0].isdigit() else f"x{name}"
        other = other if other != name else f"{plain}_1"
        raise SpecError(loc, f"{what} '{name}' is reserved in generated code: {why}", f"rename it, e.g. '{other}'")


def _show(name) -> str:
    if isinstance(name, str):
        return repr(str(name)) if len(name) <= 40 else repr(str(name)[:37] + "...")
    if isinstance(name, bool) or name is None:
        return {True: "true", False: "false", None: "null"}[name]
    if isinstance(name, (int, float)):
        return repr(name)
    return f"({'a list' if isinstance(name, list) else 'a mapping' if isinstance(name, dict) else type(name).__name__})"


def parse_step(text, loc: Loc) -> Step:
    if not isinstance(text, str):
        kind = {dict: "a mapping", list: "a list", bool: "a boolean", type(None): "nothing (null)"}
        got = next((v for t, v in kind.items() if isinstance(text, t)), "a number")
        raise SpecError(loc, f"a forward step must be a string like 'y = f(x)', got {got}",
                        "quote a step that contains ': ' or starts with a YAML symbol" if isinstance(text, dict) else STEP_HINT)
    base = text.loc_at(0) if hasattr(text, "loc_at") else loc
    stripped = text.strip()
    lead = len(text) - len(text.lstrip())
    try:
        return _parse_step(stripped, base.shifted(lead))
    except (RecursionError, MemoryError):
        raise SpecError(base.shifted(lead), "step is nested too deeply", "split it into several steps") from None


def _parse_step(stripped: str, at: Loc) -> Step:
    if stripped.startswith("return") and (len(stripped) == 6 or not (stripped[6].isalnum() or stripped[6] == "_")):
        rest = stripped[len("return"):]
        skip = len(stripped) - len(rest.strip())
        node = _parse(rest.strip(), at.shifted(skip))
        names = node.elts if isinstance(node, ast.Tuple) else [node]
        returns = []
        for n in names:
            if not isinstance(n, ast.Name):
                raise SpecError(at.shifted(skip + char_col(rest.strip(), n)), "return takes variable names only",
                                "assign the expression to a name first")
            returns.append(n.id)
        return Step([], None, returns, stripped, at)
    try:
        tree = parse_python(stripped, "exec")
    except SyntaxError as e:
        _keyword_as_name(stripped, at)
        raise SpecError(at.shifted(error_col(stripped, e)), f"bad step '{_clip(stripped)}': {syntax_message(e)}",
                        STEP_HINT) from None
    except ValueError as e:  # e.g. a NUL character
        raise SpecError(at, f"bad step: {e}", STEP_HINT) from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign) or len(tree.body[0].targets) != 1:
        raise SpecError(at, f"bad step '{_clip(stripped)}'", STEP_HINT)
    assign = tree.body[0]
    target = assign.targets[0]
    names = target.elts if isinstance(target, ast.Tuple) else [target]
    targets = []
    for n in names:
        where = at.shifted(char_col(stripped, n))
        if not isinstance(n, ast.Name):
            raise SpecError(where, "only plain names can be assigned", "write 'y = f(x)' or 'a, b = f(x)'")
        check_identifier(n.id, where, "variable")
        targets.append(n.id)
    if len(set(targets)) != len(targets):
        raise SpecError(at, f"a name is assigned twice in '{_clip(stripped)}'")
    expr = _Exprs(stripped, at).expr(assign.value)
    return Step(targets, expr, [], stripped, at)


def _keyword_as_name(text: str, at: Loc) -> None:
    """A Python keyword used as a name makes the step unparsable; say so rather than 'invalid syntax'."""
    for m in _WORD.finditer(text):
        before, after = text[: m.start()].rstrip()[-1:], text[m.end():].lstrip()[:1]
        if (keyword.iskeyword(m.group()) and m.group() not in ("None", "True", "False")
                and before in ("", ",", "(", "=", "+", "*") and after in ("", ",", ")", "=", "+", "*")):
            raise SpecError(at.shifted(m.start()), f"'{m.group()}' is a Python keyword and cannot name a variable",
                            f"rename it, e.g. '{m.group()}_'")


def _clip(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _parse(source: str, loc: Loc):
    if not source:
        raise SpecError(loc, "return needs a value", "write 'return y'")
    try:
        return parse_python(source, "eval").body
    except SyntaxError as e:
        _keyword_as_name(source, loc)
        raise SpecError(loc.shifted(error_col(source, e)), f"bad return value '{_clip(source)}': {syntax_message(e)}",
                        "write 'return y' or 'return a, b'") from None
    except ValueError as e:
        raise SpecError(loc, f"bad return value: {e}", "write 'return y' or 'return a, b'") from None


class _Exprs:
    """Expression nodes of one step, located in its text."""

    def __init__(self, text: str, base: Loc):
        self.text, self.base = text, base

    def at(self, node) -> Loc:
        return self.base.shifted(char_col(self.text, node))

    def expr(self, node) -> Expr:
        if isinstance(node, ast.Name):
            return Expr("var", self.at(node), name=node.id)
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name):
                raise SpecError(self.at(node), "only submodules can be called, by their plain name",
                                "write 'y = name(x)' where name is a submodule")
            if node.keywords:
                raise SpecError(self.at(node.keywords[0]), "keyword arguments are not supported in forward steps",
                                "pass inputs by position")
            args = []
            for a in node.args:
                if isinstance(a, ast.Starred):
                    raise SpecError(self.at(a), "starred arguments are not supported", "pass inputs by position")
                args.append(self.expr(a))
            return Expr("call", self.at(node.func), name=node.func.id, args=args)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            kind = "add" if isinstance(node.op, ast.Add) else "mul"
            left, right = self.expr(node.left), self.expr(node.right)
            args = []
            for side in (left, right):  # a + b + c is one n-ary sum, so partial sums can meet first
                args.extend(side.args if kind == "add" and side.kind == "add" else [side])
            return Expr(kind, self.at(node), args=args)
        shown = ast.unparse(node)
        raise SpecError(self.at(node), f"unsupported expression '{_clip(shown)}' in a forward step",
                        "use names, submodule calls, + and *")
