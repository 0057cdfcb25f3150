"""`specc diff`: what changed between two plans, readable in a CI log."""

from __future__ import annotations

import json
import os
import shlex

from ..errors import Loc, SpecError
from ..settings import Settings
from .render import human_bytes, plan_dict


def load_side(path: str, flags: str, compile_spec) -> dict:
    """A plan as a dict: from a saved plan.json, a generated folder, or compiled from a spec with
    its own flags: compile_spec(path, words) -> graph, the command line's parsing of the flags."""
    if path.endswith(".json"):
        if flags:
            raise SpecError(Loc(path), "flags apply to specs, not to a saved plan")
        if os.path.lexists(path) and not os.path.isfile(path):  # a FIFO would block, /dev/zero never end
            raise SpecError(Loc(path), "not a regular file (a plan.json is one)")
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise SpecError(Loc(path), "no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpecError(Loc(path, getattr(e, "lineno", 0), getattr(e, "colno", 0)), f"not a plan.json: {e}") from None
        except RecursionError:  # nested deeper than Python's parser recurses
            raise SpecError(Loc(path), "not a plan.json (nested too deeply)") from None
        except ValueError as e:  # an integer of more digits than int() takes
            raise SpecError(Loc(path), f"not a plan.json ({str(e).split(':')[0]})") from None
        if not isinstance(data, dict) or "ops" not in data or "totals" not in data:
            raise SpecError(Loc(path), "not a plan.json (no 'ops' and 'totals')", "save one with `specc plan SPEC --json`")
        data["_label"] = path
        return data
    if path.endswith(".txt"):
        raise SpecError(Loc(path), "text plans are for people; diff a spec or a plan.json", "`specc plan SPEC --json > plan.json`")
    if os.path.isdir(path):  # a generated folder: rebuilt from what its model.py records (SETTINGS)
        if flags:
            raise SpecError(Loc(path), "flags apply to specs, not to a generated folder (it records its own)")
        from ..compiler import load_and_compile
        from ..emit.recipe import command_of, overrides_of, read_recipe, settings_of
        from . import build_plan

        model = os.path.join(path, "model.py")
        if not os.path.isfile(model):
            raise SpecError(Loc(path), "holds no model.py", "diff a spec, a plan.json or a folder `specc compile` wrote")
        recipe = read_recipe(model)
        _, graph = load_and_compile(recipe["spec"], settings_of(recipe), overrides_of(recipe), plan_only=True)
        data = plan_dict(build_plan(graph))
        data["_label"] = f"{path} ({command_of(recipe)})"
        return data
    try:
        words = shlex.split(flags)
    except ValueError as e:
        raise SpecError(Loc(f"flags '{flags}'"), str(e)) from None
    from . import build_plan

    graph = compile_spec(path, words)
    data = plan_dict(build_plan(graph))
    data["_label"] = f"{path} {flags}".strip()
    return data


def _op_key(op: dict) -> str:
    return op["name"]


def _colls(items) -> str:
    return " + ".join(f"{c['collective']} {human_bytes(c['bytes'])}" for c in items) or "-"


def _describe(op: dict) -> str:
    return (f"{op['kind']} [{op['impl']}] {','.join(op['layouts_in'])} -> {','.join(op['layouts_out'])}; "
            f"fwd {_colls(op['forward'])}; bwd {_colls(op['backward'])}" + (f" x{op['count']}" if op["count"] > 1 else ""))


def _shapes(weights) -> str:
    return ", ".join(f"{n} [{'x'.join(str(d) for d in shape)}]" for n, shape in sorted((weights or {}).items())) or "-"


_FIELDS = (  # (plan.json key, label, how to print it): the fields a changed op line names
    ("kind", "kind", str),
    ("impl", "impl", str),
    ("layouts_in", "in", lambda v: ",".join(v)),
    ("layouts_out", "out", lambda v: ",".join(v)),
    ("forward", "fwd", _colls),
    ("backward", "bwd", _colls),
    ("count", "count", str),
    ("weights", "weights", _shapes),
    ("saved_bytes", "saved", lambda v: human_bytes(v or 0)),
    ("notes", "notes", lambda v: "; ".join(v or []) or "-"),
)


def _op_changes(name: str, oa: dict, ob: dict) -> list:
    """One `~` line per changed field, naming it, e.g. `~ attn.qkv: weights weight [96x32] -> weight [48x32]`."""
    out = []
    for key, label, show in _FIELDS:
        x, y = oa.get(key), ob.get(key)
        if x == y:
            continue
        sx, sy = show(x), show(y)
        if sx == sy:  # e.g. saved bytes that round to the same human size: print the exact values
            sx, sy = json.dumps(x, sort_keys=True), json.dumps(y, sort_keys=True)
        out.append(f"  ~ {name}: {label} {sx} -> {sy}")
    return out


def diff_plans(a: dict, b: dict):
    lines = [f"--- {a['_label']}", f"+++ {b['_label']}"]
    defaults = Settings().as_dict()  # a plan.json written before a setting existed had its default
    sa, sb = {**defaults, **a.get("settings", {})}, {**defaults, **b.get("settings", {})}
    changed = [f"{k} {sa.get(k)} -> {sb.get(k)}" for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]
    if changed:
        lines.append("settings: " + "; ".join(changed))
    ops_a = {_op_key(o): o for o in a["ops"]}
    ops_b = {_op_key(o): o for o in b["ops"]}
    op_lines = []
    for name in list(ops_a) + [n for n in ops_b if n not in ops_a]:
        oa, ob = ops_a.get(name), ops_b.get(name)
        if oa is None:
            op_lines.append(f"  + {name}: {_describe(ob)}")
        elif ob is None:
            op_lines.append(f"  - {name}: {_describe(oa)}")
        else:
            op_lines += _op_changes(name, oa, ob)
    if op_lines:
        lines.append("ops:")
        lines += op_lines
    total_lines = _totals(a["totals"], b["totals"])
    if total_lines:
        lines.append("totals:")
        lines += total_lines
    differ = bool(changed or op_lines or total_lines)
    if not differ:
        lines.append("plans are identical")
    return "\n".join(lines) + "\n", differ


def _totals(ta: dict, tb: dict) -> list:
    out = []
    ca, cb = ta.get("collectives", {}), tb.get("collectives", {})
    for kind in sorted(set(ca) | set(cb)):
        x, y = ca.get(kind, {"count": 0, "bytes": 0}), cb.get(kind, {"count": 0, "bytes": 0})
        if x != y:
            out.append(f"  {kind}: {x['count']} x {human_bytes(x['bytes'])} -> {y['count']} x {human_bytes(y['bytes'])}"
                       f" ({_signed(y['bytes'] - x['bytes'])})")
    ga, gb = ta.get("grad_sync", {}), tb.get("grad_sync", {})
    for kind in sorted(set(ga) | set(gb)):
        x, y = ga.get(kind, {"count": 0, "bytes": 0}), gb.get(kind, {"count": 0, "bytes": 0})
        if x != y:
            out.append(f"  grad sync {kind}: {x['count']} x {human_bytes(x['bytes'])} -> {y['count']} x "
                       f"{human_bytes(y['bytes'])} ({_signed(y['bytes'] - x['bytes'])}, once per step)")
    labels = {"parameter_bytes": "parameters", "gradient_bytes": "gradients", "optimizer_bytes": "optimizer state",
              "activation_bytes": "activations"}
    for key, label in labels.items():
        x, y = ta.get(key, 0), tb.get(key, 0)
        if x != y:
            pct = f", {100.0 * (y - x) / x:+.1f}%" if x else ""
            out.append(f"  {label}: {human_bytes(x)} -> {human_bytes(y)} ({_signed(y - x)}{pct})")
    return out


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "-") + human_bytes(abs(n))
