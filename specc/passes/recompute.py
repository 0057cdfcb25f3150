"""Activation recompute: which parts of the graph keep only their inputs for backward and run
their forward again there (Megatron's `--recompute-granularity`, `--recompute-method`,
`--recompute-num-layers`, and a module's `recompute:` in the spec).

* full: a module call (a layer, or a group of consecutive layers under `uniform`) is one
  region; it keeps only its call's arguments, and backward runs its whole forward again.
* selective: each op whose kind declares `selective_recompute` (the attention core: what it keeps
  grows with s², its share of the FLOPs is small; Korthikanti et al. 2022) is a region of its own.

A region inside another full region is dropped: the outer one already keeps nothing inside it.
The plan reads the regions for memory, collectives and FLOPs; the emitter for the calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Loc, SpecError
from ..ops import OPS


@dataclass
class Region:
    granularity: str  # "full" | "selective"
    scopes: tuple  # full: the consecutive module-instance scopes it covers; selective: ()
    op_id: str | None  # selective: the op
    inputs: list  # value ids its checkpoint keeps: the call's arguments
    source: str  # what asked for it (a flag or the spec's module)


@dataclass
class Recompute:
    regions: list = field(default_factory=list)
    op_region: dict = field(default_factory=dict)  # op id -> index of the region it runs in
    calls: dict = field(default_factory=dict)  # module-instance scope recomputed on its own -> region index
    groups: dict = field(default_factory=dict)  # repeated scope -> ("all",) | ("block", n) | ("uniform", n)
    selective: dict = field(default_factory=dict)  # op id -> region index (a recomputed op on its own)


def selective_kinds() -> list:
    return sorted(name for name, kind in OPS.items() if kind.selective_recompute)


def mark_recompute(g) -> Recompute:
    """Find the regions for the spec's declarations and the settings; set g.recompute."""
    s, modules = g.spec.settings, g.spec.modules
    full, selective = [], []  # (scopes, source) / (op id, source)
    root = modules[g.spec.root]
    if root.recompute:
        raise SpecError(root.recompute_loc, f"the model's root module '{root.name}' cannot be recomputed: its "
                        "backward would run the whole model again with nothing kept",
                        "declare recompute: on the modules it calls (e.g. its repeated layer)")
    ops = list(g.iter_ops())
    first = _first_ops(ops)
    if s.recompute_granularity == "full":
        full += _flag_regions(g, s, first)
    instances = sorted(scope for scope in g.scopes if scope)
    for scope in instances:
        mdef = modules[g.scopes[scope]]
        if mdef.recompute == "full":
            full.append(((scope,), f"spec: {mdef.name} recompute: full"))
    covered = [op.id for op in ops if OPS[op.kind].selective_recompute]
    if s.recompute_granularity == "selective":
        if not covered:
            raise SpecError(Loc("--recompute-granularity selective"), "no op of this spec is one selective "
                            f"recompute covers ({', '.join(selective_kinds())})",
                            "use --recompute-granularity full --recompute-method uniform")
        selective += [(op_id, "--recompute-granularity selective") for op_id in covered]
    for name, mdef in sorted(modules.items()):
        if mdef.recompute != "selective":
            continue
        scopes = [scope for scope in instances if g.scopes[scope] == name]
        mine = [op.id for op in ops if OPS[op.kind].selective_recompute and any(_within(op.scope, x) for x in scopes)]
        if not mine and scopes:
            raise SpecError(mdef.recompute_loc, f"module '{name}' holds no op that selective recompute covers "
                            f"({', '.join(selective_kinds())})", "use recompute: full to recompute the whole module")
        selective += [(op_id, f"spec: {name} recompute: selective") for op_id in mine]

    rc = Recompute()
    kept: list = []  # full regions kept, outermost first
    for scopes, source in sorted(full, key=lambda r: (r[0][0].count("."), -len(r[0]), r[0][0])):
        if any(_within(scopes[0], x) for region in kept for x in region.scopes):
            continue
        kept.append(Region("full", scopes, None, list(g.calls[scopes[0]][0]), source))
    for region in sorted(kept, key=lambda r: first.get(r.scopes[0], len(ops))):
        index = len(rc.regions)
        rc.regions.append(region)
        if len(region.scopes) == 1:
            rc.calls[region.scopes[0]] = index
    seen = set()
    for op in ops:
        for index, region in enumerate(rc.regions):
            if any(_within(op.scope, x) for x in region.scopes):
                rc.op_region[op.id] = index
                break
    for op_id, source in selective:
        if op_id in rc.op_region or op_id in seen:
            continue
        seen.add(op_id)
        index = len(rc.regions)
        rc.regions.append(Region("selective", (), op_id, list(g.ops[op_id].inputs), source))
        rc.op_region[op_id] = rc.selective[op_id] = index
    rc.groups = _group_forms(g, rc)
    g.recompute = rc
    return rc


def _flag_regions(g, s, first: dict) -> list:
    """Megatron's full recompute over the outermost repeated modules (the layers): uniform cuts
    them into groups of `num_layers` consecutive layers, each one region; block recomputes the
    first `num_layers` layers, each on its own, and keeps the rest as they are."""
    groups = [scope for scope in g.repeats if not _inside_repeat(g, scope)]
    if not groups:
        raise SpecError(Loc("--recompute-granularity full"), "the spec repeats no module: full recompute "
                        "works on layers (a submodule with repeat:)", "declare recompute: full on a module in the spec")
    n, method, out = s.recompute_num_layers, s.recompute_method, []
    source = f"--recompute-granularity full --recompute-method {method} --recompute-num-layers {n}"
    for group in sorted(groups, key=lambda x: first.get(f"{x}.0", len(first))):
        count = g.repeats[group]
        if n > count:
            raise SpecError(Loc(f"--recompute-num-layers {n}"), f"is more than the {count} layers of '{group}'",
                            f"choose 1 to {count}")
        if method == "uniform":
            out += [(tuple(f"{group}.{i}" for i in range(start, min(start + n, count))), source)
                    for start in range(0, count, n)]
        else:
            out += [((f"{group}.{i}",), source) for i in range(n)]
    return out


def _group_forms(g, rc: Recompute) -> dict:
    """How the emitter writes each repeated group's loop: every layer recomputed on its own
    ("all"), the first n ("block"), or groups of n ("uniform")."""
    forms = {}
    for group, count in g.repeats.items():
        starts = {}
        for region in rc.regions:
            if region.granularity == "full" and region.scopes[0].rsplit(".", 1)[0] == group \
                    and g.is_instance(region.scopes[0]):
                starts[int(region.scopes[0].rsplit(".", 1)[1])] = len(region.scopes)
        if not starts:
            continue
        sizes = set(starts.values())
        if sizes == {1} and sorted(starts) == list(range(count)):
            forms[group] = ("all",)
        elif sizes == {1} and sorted(starts) == list(range(len(starts))):
            forms[group] = ("block", len(starts))
        else:
            n = starts[0] if 0 in starts else 0
            if not n or sorted(starts) != list(range(0, count, n)) or \
                    any(size != min(n, count - i) for i, size in starts.items()):
                raise AssertionError(f"recompute regions of {group} have no loop form: {sorted(starts.items())}")
            forms[group] = ("uniform", n)
    return forms


def _within(scope: str, outer: str) -> bool:
    return scope == outer or scope.startswith(outer + ".")


def _inside_repeat(g, scope: str) -> bool:
    parts = scope.split(".")
    return any(".".join(parts[:i]) in g.repeats for i in range(1, len(parts)))


def _first_ops(ops: list) -> dict:
    """Module-instance scope -> the position of its first op in execution order."""
    first = {}
    for i, op in enumerate(ops):
        parts = op.scope.split(".") if op.scope else []
        for j in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:j]), i)
    return first
