"""The checks of a spec's modules once they are read: every forward's dataflow (names defined
before use, every callee a submodule, one final return) and the module graph (references exist,
no module contains itself, arities agree, the expanded model stays under MAX_OPS)."""

from __future__ import annotations

from ..errors import SpecError, did_you_mean
from ..ops import SPEC_OPS
from .model import ModuleDef, Ref

MAX_MODULE_DEPTH = 32  # modules that contain modules that contain ...
MAX_OPS = 100_000  # ops after repeats are expanded: a 1000-layer model has about 20,000


def check_dataflow(m: ModuleDef) -> None:
    """Every name defined before use, every callee a submodule, one final return."""
    defined = {n: m.loc for n in m.inputs}
    used_subs = set()
    for i, step in enumerate(m.steps):
        if step.expr is None:
            if i != len(m.steps) - 1:
                raise SpecError(m.steps[i + 1].loc, "step after 'return' is never run", "return must be the last step")
            for n in step.returns:
                if n not in defined:
                    raise SpecError(step.loc, f"return of undefined variable '{n}'", did_you_mean(n, defined))
            m.returns = list(step.returns)
            continue
        _check_expr(step.expr, m, defined, used_subs, step, i)
        for t in step.targets:
            defined[t] = step.loc
    if not m.steps or m.steps[-1].expr is not None:
        raise SpecError(m.steps[-1].loc if m.steps else m.loc, f"module '{m.name}' does not end with a 'return' step",
                        "add e.g. 'return y'")
    for name, sub in m.submodules.items():
        if name not in used_subs:
            raise SpecError(sub.name_loc or sub.loc, f"submodule '{name}' is never called in {m.name}'s forward",
                            "call it in a step or remove it")


def _check_expr(e, m: ModuleDef, defined: dict, used_subs: set, step, index: int) -> None:
    if e.kind == "var":
        if e.name not in defined:
            later = [s for s in m.steps[index:] if e.name in s.targets]
            hint = ("it is assigned only at a later step: dataflow must not form a cycle" if later
                    else did_you_mean(e.name, defined))
            raise SpecError(e.loc, f"undefined variable '{e.name}'", hint)
        return
    for a in e.args:
        _check_expr(a, m, defined, used_subs, step, index)
    if e.kind == "call":
        if e.name not in m.submodules:
            raise SpecError(e.loc, f"'{e.name}' is not a submodule of {m.name}", did_you_mean(e.name, m.submodules))
        used_subs.add(e.name)


def check_module_graph(modules: dict, root: str) -> None:
    """Module references must exist, agree in arity, and not contain themselves."""
    for m in modules.values():
        for sub in m.submodules.values():
            for target in (sub.modules() if isinstance(sub, Ref) else ()):
                if target not in modules:
                    raise SpecError(sub.module_locs.get(target, sub.loc), f"undefined module '{target}'",
                                    did_you_mean(target, modules))
    state: dict = {}
    ops: dict = {}  # module -> ops in one instance, repeats expanded

    def visit(name: str, path: list, loc):
        if state.get(name) == "active":
            raise SpecError(loc, "cycle in module references: " + " -> ".join(path + [name]),
                            "a module cannot contain itself")
        if state.get(name) == "done":
            return
        if len(path) >= MAX_MODULE_DEPTH:
            raise SpecError(loc, f"modules are nested more than {MAX_MODULE_DEPTH} deep")
        state[name] = "active"
        count = sum(len(step.targets) or 1 for step in modules[name].steps)  # builtins (+, *) count too
        for sub in modules[name].submodules.values():
            if isinstance(sub, Ref):
                for target in sub.modules():
                    visit(target, path + [name], sub.module_locs.get(target, sub.loc))
                count += sum(ops[sub.module_at(i)] for i in range(sub.repeat)) if sub.layer_modules else \
                    ops[sub.module] * (sub.repeat or 1)
                if count > MAX_OPS:
                    raise SpecError(sub.loc, f"the model expands to more than {MAX_OPS:,} ops",
                                    "check 'repeat' and the sizes it comes from")
        ops[name] = count
        state[name] = "done"

    visit(root, [], modules[root].loc)
    for m in modules.values():
        for step in m.steps:
            if step.expr is not None:
                _check_arity(step.expr, step.targets, m, modules, top=True)


def _check_arity(e, targets, m: ModuleDef, modules: dict, top: bool) -> None:
    if e.kind == "var":
        if top and len(targets) != 1:
            raise SpecError(e.loc, f"cannot unpack one value into {len(targets)} names")
        return
    for a in e.args:
        _check_arity(a, [None], m, modules, top=False)
    if e.kind in ("add", "mul"):
        if len(targets) != 1:
            raise SpecError(e.loc, f"'{'+' if e.kind == 'add' else '*'}' gives one value, not {len(targets)}")
        return
    sub = m.submodules[e.name]
    if isinstance(sub, Ref):
        for target in sub.modules():
            callee = modules[target]
            n_in, n_out = len(callee.inputs), len(callee.returns)
            if sub.repeat is not None and (n_in < 1 or n_out != 1):
                raise SpecError(sub.loc, f"repeated module '{target}' must take at least one input and return one value",
                                f"it takes {n_in} and returns {n_out}; the first input is threaded through the layers, "
                                "the others (a padding mask) reach every layer unchanged")
            first = modules[sub.module]
            if n_in != len(first.inputs):
                raise SpecError(sub.module_locs.get(target, sub.loc), f"the layers of '{sub.name}' take different inputs: "
                                f"'{first.name}' takes {len(first.inputs)}, '{target}' takes {n_in}",
                                "every module of a pattern takes the value threaded through the layers (and the same side inputs)")
        lo, hi = n_in, n_in
    else:
        kind = SPEC_OPS[sub.op]
        lo, hi = kind.n_inputs
        n_out = kind.out_count(sub.attrs)
    if not lo <= len(e.args) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise SpecError(e.loc, f"'{e.name}' takes {want} input(s), got {len(e.args)}")
    if len(targets) != n_out:
        raise SpecError(e.loc, f"'{e.name}' returns {n_out} value(s), but {len(targets)} name(s) receive them"
                        if top else f"'{e.name}' returns {n_out} values and cannot be nested in an expression")
