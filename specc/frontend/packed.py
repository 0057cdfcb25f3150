"""Packed documents (Megatron's --reset-position-ids and --reset-attention-mask): the spec's model
takes each token's position within its document (`position_ids`) and its document (`document_ids`),
both [batch, sequence] int64, and every op that reads them gets them as its last input: the ops
whose kind names the input as its `packed_input` (rotary and learned position embeddings read
positions, core attention reads document ids). The inputs are threaded through the module calls
that lead to those ops, as a spec would write a padding mask by hand, so that every later pass
(layouts, context parallelism, pipeline stages, recompute) sees ordinary model inputs.

This runs on the validated spec, before the graph is built; without either setting it changes
nothing. The root's new inputs go before its last one: the labels stay last (Megatron's
GPTModel.forward(input_ids, position_ids, attention_mask, labels); the pipeline's loss target)."""

from __future__ import annotations

import dataclasses

from ..errors import SpecError
from ..ops import OPS
from .model import Expr, Leaf, ModelInput, Ref, Spec

FLAGS = {"position_ids": "--reset-position-ids", "document_ids": "--reset-attention-mask"}
_SETTING = {"position_ids": "reset_position_ids", "document_ids": "reset_attention_mask"}
_READERS = {"position_ids": "rotary or position_embedding op", "document_ids": "core_attention op"}


def wanted(settings) -> list:
    """The packed-document inputs the settings ask for, in the model's input order."""
    return [name for name in FLAGS if getattr(settings, _SETTING[name], False)]


def thread_packed_inputs(spec: Spec) -> Spec:
    """The spec with the packed-document inputs its settings ask for (itself when none)."""
    names = wanted(spec.settings)
    if not names:
        return spec
    needs = _needs(spec, names)
    root = spec.modules[spec.root]
    for name in names:
        if name not in needs[spec.root]:
            raise SpecError(root.loc, f"{FLAGS[name]}: this model has no {_READERS[name]} to take {name}",
                            f"drop {FLAGS[name]}: it would change nothing")
    modules = {m: _rewrite(spec.modules[m], [n for n in names if n in needs[m]], m == spec.root, needs)
               for m in spec.modules}
    tokens = next((i for i in spec.inputs if len(i.shape) == 2 and i.dtype in ("int64", "int32")), None)
    if tokens is None:
        raise SpecError(root.loc, f"{FLAGS[names[0]]}: the model has no [batch, sequence] token input to take the "
                        "shape of its position and document ids from")
    added = [ModelInput(n, tuple(tokens.shape), "int64", tokens.loc) for n in names]
    inputs = list(spec.inputs[:-1]) + added + list(spec.inputs[-1:])
    return dataclasses.replace(spec, modules=modules, inputs=inputs)


def _needs(spec: Spec, names: list) -> dict:
    """module name -> the packed inputs its calls reach. Every module of a repeated pattern takes
    the same inputs (the layers are called alike), so a pattern's modules share their union."""
    needs = {m: set() for m in spec.modules}
    for m in spec.modules.values():
        for sub in m.submodules.values():
            if isinstance(sub, Leaf) and OPS[sub.op].packed_input in names:
                needs[m.name].add(OPS[sub.op].packed_input)
    changed = True
    while changed:  # the module graph is acyclic (checked on load): this settles within its depth
        changed = False
        for m in spec.modules.values():
            for sub in m.submodules.values():
                if not isinstance(sub, Ref):
                    continue
                union = set().union(*(needs[t] for t in sub.modules()))
                for t in sub.modules():
                    if not union <= needs[t]:
                        needs[t] |= union
                        changed = True
                if not union <= needs[m.name]:
                    needs[m.name] |= union
                    changed = True
    return needs


def _rewrite(m, names: list, root: bool, needs: dict):
    if not names:
        return m
    assigned = {t for step in m.steps for t in step.targets}
    for name in names:
        if name in m.inputs or name in assigned:
            raise SpecError(m.loc, f"{FLAGS[name]}: module '{m.name}' already has a value named '{name}', the input "
                            "the flag adds", f"rename the spec's '{name}'")
    inputs = list(m.inputs[:-1]) + names + list(m.inputs[-1:]) if root else list(m.inputs) + names
    steps = [dataclasses.replace(step, expr=_expr(m, step.expr, names, needs)) if step.expr is not None else step
             for step in m.steps]
    return dataclasses.replace(m, inputs=inputs, steps=steps)


def _expr(m, e: Expr, names: list, needs: dict) -> Expr:
    if e.kind == "var":
        return e
    args = [_expr(m, a, names, needs) for a in e.args]
    sub = m.submodules.get(e.name) if e.kind == "call" else None
    extra = []
    if isinstance(sub, Leaf):
        name = OPS[sub.op].packed_input
        if name in names:
            if len(args) >= OPS[sub.op].n_inputs[1]:
                raise SpecError(e.loc, f"{FLAGS[name]}: '{e.name}' already takes its {name.replace('_', ' ')} from "
                                "the spec (its last input)", f"drop {FLAGS[name]}: the spec's input feeds it")
            extra = [name]
    elif isinstance(sub, Ref):
        union = set().union(*(needs[t] for t in sub.modules()))
        extra = [n for n in names if n in union]
    return dataclasses.replace(e, args=args + [Expr("var", e.loc, name=n) for n in extra])

