"""Turn the typed, optimized op graph into model.py: one class per spec module (per distinct
layout signature), constructors that take the process groups explicitly, and forwards in which
every boundary is a visible call with a comment naming its collective."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import textwrap

import jinja2

from .. import __version__
from ..errors import SpecError
from ..frontend.load import builtin_names
from ..layouts import AXES, GROUP_NAMES, SH, SS, I, P, R
from ..ops import OPS
from ..ops.base import EmitCtx
from .config_expr import ConfigExprs
from .pytext import docstring_text, string_literal
from .recipe import make_recipe

_SUFFIX = {I: "full", R: "rep", SS: "seq", SH: "shard", P: "partial"}
WIDTH = 120  # the columns a comment in model.py fits in (the project's line length)
_INDENT = 8  # a method body's lines: their indent in the template
_COLL = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
         "split": "split (local)", "": "identity"}

_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                          undefined=jinja2.StrictUndefined)
# spec text reaches model.py only through these two: a docstring or a string literal it cannot end
_ENV.filters["doc"] = docstring_text
_ENV.filters["pystr"] = string_literal


def emit_model(graph, command: str, recipe: dict | None = None) -> str:
    """model.py for a compiled graph. `recipe` (emit/recipe.py) is what it was compiled from, kept
    as SETTINGS; `command` the compile command shown to people (COMPILE_COMMAND)."""
    spec, settings = graph.spec, graph.spec.settings
    emitter = _Emitter(graph)
    root_class = emitter.class_for("")
    classes = [emitter.classes[k] for k in emitter.order]
    for c in classes:
        c.init, c.body = fit_lines(c.init, emitter.trailing), fit_lines(c.body, emitter.trailing)
    body = "\n".join(ln for c in classes for ln in c.init + c.body)
    config = emitter.config.literal()
    return _ENV.get_template("model.py.j2").render(
        uses_math=emitter.config.uses_math, config_dict=_dict_literal(config) if config else None,
        uses_torch="torch." in body, uses_mappings="mappings." in body,
        size_checks=_size_checks(graph, body),
        spec_name=spec.name, description=spec.description or spec.name, version=__version__,
        spec_file=os.path.basename(spec.path), spec_hash=spec.source_hash, command=command,
        settings_line=settings.describe(), classes=classes, root_class=root_class,
        settings_dict=_dict_literal(recipe if recipe is not None else make_recipe(spec.path, settings)),
        pipeline=_pipeline_lines(graph) if graph.pipeline is not None else None,
    )


def _size_checks(graph, body: str) -> list:
    """(group, its name) for each process group build_model checks against SETTINGS: the mesh axes
    always, expert parallelism where a layer takes pg.ep, pipeline parallelism in a pipelined model."""
    used = {"ep": "pg.ep" in body, "pp": graph.pipeline is not None}
    return [(group, name) for group, name in GROUP_NAMES.items() if group in AXES or used.get(group)]


def _dict_literal(d: dict) -> str:
    """A dict as Python source, one key a line (SETTINGS: every setting, readable in the file)."""
    return "{\n" + "".join(f"    {ascii(k)}: {ascii(v)},\n" for k, v in d.items()) + "}"


def _pipeline_lines(graph) -> list:
    """PIPELINE_STAGES: per stage the layers it owns and the tensors it receives and sends."""
    pipe, s = graph.pipeline, graph.spec.settings
    chunks = f"{pipe.virtual} model chunks per rank (interleaved)" if pipe.virtual > 1 else "one model chunk per rank"
    lines = [f"# Pipeline: PP={pipe.size}, {chunks}, {pipe.num_layers} layers of {pipe.block} placed {pipe.placement}.",
             "# Stage s runs on pipeline rank s % PP; it receives its input from stage s-1 and sends its output",
             "# to stage s+1 (gradients travel back): (name, local shape, layout, bytes) per micro-batch of",
             f"# {s.micro_batch_size} on one rank. pre_process: the ops before the block; post_process: those after.",
             "PIPELINE_STAGES = ["]
    for st in pipe.stages:
        def p2p(items):
            return "[" + ", ".join(f"({x.name!r}, {list(x.shape)}, {x.layout!r}, {x.bytes})" for x in items) + "]"
        lines.append(f'    {{"stage": {st.index}, "rank": {st.rank}, "chunk": {st.chunk}, "layers": {list(st.layers)}, '
                     f'"pre_process": {st.pre_process}, "post_process": {st.post_process},')
        lines.append(f'     "recv": {p2p(st.recv)}, "send": {p2p(st.send)}}},')
    lines.append("]")
    return lines


class _Class:
    def __init__(self, name, doc, params, init, body):
        self.name, self.doc, self.params, self.init, self.body = name, doc, params, init, body


class _Emitter:
    def __init__(self, graph):
        self.g = graph
        self.mesh = graph.mesh
        self.config = ConfigExprs(graph.spec.config, graph.spec.config_exprs, builtin_names(graph.spec.settings))
        self.trailing: dict = {}  # line -> (code, its trailing comment): fit_lines may split them
        self.classes: dict = {}  # signature -> _Class
        self.order: list = []  # signatures, children before parents
        self.names: dict = {}  # module name -> count of classes made for it
        self.items = self._items_by_scope()
        self.recompute = graph.recompute if graph.recompute is not None and graph.recompute.regions else None

    # -- structure --------------------------------------------------------------------------
    def _items_by_scope(self) -> dict:
        """For every module instance scope, its own ops and its child calls, in execution order
        (a child's call sits where the child's first op runs)."""
        items: dict = {s: [] for s in list(self.g.scopes) + list(self.g.repeats)}
        announced: set = set()
        for op in self.g.iter_ops():
            items[op.scope].append(("op", op))
            scope = op.scope
            while scope and scope not in announced:
                child, parent = self._child_of(scope)
                announced.add(scope)
                if child not in announced or child == scope:
                    announced.add(child)
                    items[parent].append(("call", child))
                scope = parent
        return items

    def _child_of(self, scope: str):
        """(the child call that contains `scope`, the scope that makes that call)."""
        parent = scope.rsplit(".", 1)[0] if "." in scope else ""
        if parent in self.g.repeats:  # layers.3 is called through the repeated group `layers`
            return parent, self.g.caller_of(scope)
        return scope, parent

    def class_for(self, scope: str) -> str:
        module = self.g.scopes[scope]
        init, body, params = self._emit_scope(scope)
        key = (module, tuple(init), tuple(body), tuple(params))
        if key not in self.classes:
            n = self.names.get(module, 0) + 1
            name = module if n == 1 else f"{module}_{n}"
            while n > 1 and (name in self.g.spec.modules or any(c.name == name for c in self.classes.values())):
                n += 1  # a variant's class must not take the name of a spec module (or another variant)
                name = f"{module}_{n}"
            self.names[module] = n
            mdef = self.g.spec.modules[module]
            doc = mdef.description or f"The spec module {module}."
            if n > 1:
                doc += " (A variant: its layouts differ from the first instance's.)"
            doc = textwrap.fill(doc, width=92, subsequent_indent="    ")
            self.classes[key] = _Class(name, doc, params, init, body)
            self.order.append(key)
        return self.classes[key].name

    # -- one module -------------------------------------------------------------------------
    def _emit_scope(self, scope: str):
        g = self.g
        mdef = g.spec.modules[g.scopes[scope]]
        args, outs = g.calls[scope]
        names = _Names(mdef.inputs, args)
        items = self.items[scope]
        last_use = self._last_uses(items, outs)
        init, body, built = [], [], {}
        partial, marks = [], {}  # marks: parameter -> (its partial axes, the layouts it is used on, first item)
        starts, init_starts, partial_at = [], [], {}  # where each item's lines begin (pipeline stages)
        for index, (what, x) in enumerate(items):
            starts.append(len(body))
            init_starts.append(len(init))
            if what == "call":
                body += self._call_lines(x, names, index, last_use, init)
                continue
            op = x
            kind = OPS[op.kind]
            line, comment = self._op_line(op, names, index, last_use)
            if comment:
                body.append(f"# {comment}")
            body.append(line)
            if not kind.converts():
                ctor = self._constructor(op)
                if ctor and op.attr_name not in built:
                    built[op.attr_name] = ctor
                    init.append(f"self.{op.attr_name} = {ctor}")
                elif ctor and built[op.attr_name] != ctor:
                    # one module, one constructor: never emit a module that cannot run
                    raise SpecError(op.loc, f"{op.attr_name} is called at several places whose layouts need "
                                    f"different modules ({built[op.attr_name]} and {ctor})",
                                    "give each call its own submodule, or make their inputs alike")
            owner = kind.owner(op)
            for w in op.partial_grad:  # one mark per weight: the axes of all its uses (marks add up)
                axes, used_on, _ = marks.setdefault(f"self.{owner}.{w}", (set(), [], index))
                axes.update(a for a in self.mesh.axes if w in op.partial_grads.get(a, ()))
                if str(op.in_layouts[0]) not in used_on:
                    used_on.append(str(op.in_layouts[0]))
        for param, (axes, used_on, index) in marks.items():
            where = f"used on {' and '.join(used_on)} values"
            if axes == {"tp"}:
                partial.append(self._commented(f"runtime.mark_tp_partial_grad({param})", where))
            else:
                named = ", ".join(f'"{a}"' for a in self.mesh.axes if a in axes)
                partial.append(self._commented(f"runtime.mark_partial_grad({param}, {named})", where))
            partial_at.setdefault(partial[-1], index)
        if scope == "" and self.g.pipeline is not None:
            return self._pipeline_root(mdef, items, names, init, body, starts, init_starts, partial_at, outs)
        body.append("return " + ", ".join(names.get(v) for v in outs))
        init = self._handles_used(init, body)
        init = _order_ties(init) + sorted(set(partial), key=partial.index)
        return init, body, list(mdef.inputs)

    def _handles_used(self, init: list, body: list) -> list:
        """`init` preceded by the attributes the module's lines read: `self.<axis> = pg.<axis>` for
        each process group they name (self.tp first) and the RNG tracker a recompute replays. The
        lines are this emitter's own, where a group appears only as `self.<axis>`."""
        text = "\n".join(init + body)
        head = [f"self.{axis} = pg.{axis}" for axis in self.mesh.axes if re.search(rf"\bself\.{axis}\b", text)]
        if "rng_tracker=self.rng_tracker" in text:
            head.insert(0, "self.rng_tracker = rng_tracker")
        return head + init

    def _commented(self, code: str, comment: str) -> str:
        """`code  # comment`; where that runs past the line width, fit_lines puts the comment
        on a line of its own above the code."""
        line = f"{code}  # {comment}"
        self.trailing[line] = (code, comment)
        return line

    def _last_uses(self, items, outs) -> dict:
        last = {}
        for i, (what, x) in enumerate(items):
            used = self.g.calls[x][0] if what == "call" else x.inputs
            for v in used:
                last[v] = i
        for v in outs:
            last[v] = len(items)
        return last

    def _call_lines(self, child: str, names, index: int, last_use: dict, init: list) -> list:
        g = self.g
        attr = child.rsplit(".", 1)[-1]
        args, outs = g.calls[child]
        arg_names = [names.get(v) for v in args]
        if child in g.repeats and g.pipeline is not None and child == g.pipeline.block:
            return self._stage_layers(child, attr, names, arg_names, outs, index, last_use, init)
        if child in g.repeats:
            count = g.repeats[child]
            classes = [self.class_for(f"{child}.{i}") for i in range(count)]
            if len(set(classes)) == 1:
                init.append(f"self.{attr} = nn.ModuleList([{classes[0]}(pg, rng_tracker) for _ in range({count})])")
            else:
                init.append(f"self.{attr} = nn.ModuleList([" + ", ".join(f"{c}(pg, rng_tracker)" for c in classes) + "])")
            out = names.bind(outs[0], g.call_names[child][0], index, last_use)
            lines = [] if out == arg_names[0] else [f"{out} = {arg_names[0]}"]
            rest = "".join(f", {n}" for n in arg_names[1:])  # side inputs (a padding mask) reach every layer
            return lines + self._layer_loop(child, attr, out, count, rest)
        init.append(f"self.{attr} = {self.class_for(child)}(pg, rng_tracker)")
        out_names = [names.bind(v, n, index, last_use) for v, n in zip(outs, g.call_names[child])]
        if self.recompute is not None and child in self.recompute.calls:
            region = self.recompute.regions[self.recompute.calls[child]]
            return [f"# recompute (full): {attr} keeps only its inputs; backward runs its forward again ({region.source})",
                    f"{', '.join(out_names)} = runtime.recompute(self.{attr}, {', '.join(arg_names)}, "
                    f"rng_tracker=self.rng_tracker)"]
        return [f"{', '.join(out_names)} = self.{attr}({', '.join(arg_names)})"]

    def _layer_loop(self, group: str, attr: str, out: str, count: int, rest: str = "") -> list:
        """The loop over a repeated module's instances, with Megatron's recompute methods; `rest`:
        the side inputs every instance also takes."""
        form = self.recompute.groups.get(group) if self.recompute is not None else None
        if form is None:
            return [f"for layer in self.{attr}:", f"    {out} = layer({out}{rest})"]
        first = self.recompute.regions[self.recompute.calls.get(f"{group}.0", 0)] if form[0] != "uniform" else None
        call = f"runtime.recompute({{}}, {out}{rest}, rng_tracker=self.rng_tracker)"
        if form[0] == "all":
            return [f"# recompute (full): every layer keeps only its input; backward runs its forward again "
                    f"({first.source})",
                    f"for layer in self.{attr}:", f"    {out} = {call.format('layer')}"]
        n = form[1]
        if form[0] == "block":
            return [f"# recompute (full, block): the first {n} of {count} layers keep only their input; backward "
                    "runs their forward again",
                    f"for i, layer in enumerate(self.{attr}):",
                    f"    {out} = {call.format('layer')} if i < {n} else layer({out}{rest})"]
        return [f"# recompute (full, uniform): each group of {n} layers keeps only its input; backward runs the "
                "group's forward again",
                f"for start in range(0, {count}, {n}):",
                f"    {out} = {call.format(f'self.{attr}[start:start + {n}]')}"]

    def _op_line(self, op, names, index: int, last_use: dict):
        g = self.g
        kind = OPS[op.kind]
        args = [names.get(v) for v in op.inputs]
        layouts = ""
        if self.mesh.active:
            layouts = f"{','.join(map(str, op.in_layouts))} -> {','.join(map(str, op.out_layouts))}"
        call = kind.call(op, args, self._ctx(op))
        if self.recompute is not None and op.id in self.recompute.selective:
            plain = f"self.{op.attr_name}({', '.join(args)})"
            if call != plain:
                raise AssertionError(f"{op.kind} declares selective_recompute but its call is {call!r}, not {plain!r}")
            call = f"runtime.recompute(self.{op.attr_name}, {', '.join(args)}, rng_tracker=self.rng_tracker)"
        if kind.converts():
            out = names.bind(op.outputs[0], args[0], index, last_use, kind.name_suffix(op))
            return f"{out} = {call}", kind.describe(op)
        outs = [names.bind(v, g.values[v].name, index, last_use) for v in op.outputs]
        line = f"{', '.join(outs)} = {call}"
        if layouts:
            line = self._commented(line, layouts)
        note = kind.note(op)
        if self.recompute is not None and op.id in self.recompute.selective:
            source = self.recompute.regions[self.recompute.selective[op.id]].source
            note = "; ".join(filter(None, [note, f"recompute (selective): keeps only its inputs; backward runs it "
                                                 f"again ({source})"]))
        return line, note

    def _ctx(self, op) -> EmitCtx:
        tied = f"self.{self.g.ops[op.tied_to].attr_name}.weight" if op.tied_to else ""
        return EmitCtx(**dict(self.mesh.sizes), tied_expr=tied, expr_of=lambda name: self.config.attr(op, name),
                       in_segments=[tuple(self.g.values[v].segments) for v in op.inputs],
                       in_units=[tuple(self.g.values[v].units) for v in op.inputs])

    def _constructor(self, op) -> str | None:
        if self.g.pipeline is not None and any(op.id == copy for _, copy in self.g.pipeline.ties):
            op = dataclasses.replace(op, tied_to=None)  # the last stage's own copy of a tied weight
        return OPS[op.kind].constructor(op, self._ctx(op))

    # -- pipeline parallelism: the root module built per stage ---------------------------------------
    def _stage_layers(self, child, attr, names, arg_names, outs, index, last_use, init) -> list:
        """The repeated block at PP > 1: only this rank's layers, keyed by their global index (so
        parameter names, and checkpoints, are the same at every pipeline size); a stage runs its own."""
        g = self.g
        classes = [self.class_for(f"{child}.{i}") for i in range(g.repeats[child])]
        build = classes[0] if len(set(classes)) == 1 else "(" + ", ".join(classes) + ",)[i]"
        init.append(f"self.{attr} = nn.ModuleDict({{str(i): {build}(pg, rng_tracker) "
                    f"for s in self.stages for i in s[\"layers\"]}})")
        out = names.bind(outs[0], g.call_names[child][0], index, last_use)
        lines = [] if out == arg_names[0] else [f"{out} = {arg_names[0]}"]
        rest = "".join(f", {n}" for n in arg_names[1:])  # side inputs: model inputs, which every stage receives
        form = self.recompute.groups.get(child) if self.recompute is not None else None
        if form is None:
            return lines + ['for i in PIPELINE_STAGES[stage]["layers"]:', f"    {out} = self.{attr}[str(i)]({out}{rest})"]
        if form[0] != "all":
            raise SpecError(g.spec.modules[g.spec.root].loc, f"--recompute-method {form[0]} with pipeline parallelism "
                            f"is not supported: its layer groups would straddle the stages",
                            "use --recompute-granularity full without --recompute-method uniform/block, or selective")
        return lines + ["# recompute (full): every layer keeps only its input; backward runs its forward again",
                        'for i in PIPELINE_STAGES[stage]["layers"]:',
                        f"    {out} = runtime.recompute(self.{attr}[str(i)], {out}{rest}, rng_tracker=self.rng_tracker)"]

    def _pipeline_root(self, mdef, items, names, init, body, starts, init_starts, partial_at, outs):
        """The root class at PP > 1 (Megatron's pre_process/post_process): a rank builds the parts
        of its stages only, and forward(stage=s) runs stage s: the embedding side on the first,
        the layers it owns, the output side on the last."""
        g, pipe = self.g, self.g.pipeline
        block_item = next(i for i, (what, x) in enumerate(items) if what == "call" and x == pipe.block)
        carry = names.get(g.calls[pipe.block][0][0])
        if carry in mdef.inputs:
            raise SpecError(mdef.loc, f"the repeated block {pipe.block} reads the model input {carry} itself: "
                            f"a pipeline stage receives the block's running value, which must be computed "
                            f"from the inputs first", "drop --pipeline-model-parallel-size")
        starts = starts + [len(body)]
        init_starts = init_starts + [len(init)]
        pre_init, block_init, post_init = (init[:init_starts[block_item]],
                                           init[init_starts[block_item]:init_starts[block_item + 1]],
                                           init[init_starts[block_item + 1]:])
        pre_body, block_body, post_body = (body[:starts[block_item]], body[starts[block_item]:starts[block_item + 1]],
                                           body[starts[block_item + 1]:])
        pre_partial = sorted({ln for ln, i in partial_at.items() if i < block_item}, key=list(partial_at).index)
        post_partial = sorted({ln for ln, i in partial_at.items() if i > block_item}, key=list(partial_at).index)
        pre_init, post_init = _order_ties(pre_init) + pre_partial, _order_ties(post_init) + post_partial
        for owner, copy in pipe.ties:
            op = g.ops[copy]
            std = g.ops[op.tied_to].attrs.get("init_std")
            std_expr = self.config.attr(g.ops[op.tied_to], "init_std") or repr(std)
            std_arg = f", init_std={std_expr}" if std is not None else ""
            pre_init.append(f"runtime.tie_across_stages(self.{g.ops[op.tied_to].attr_name}.weight, "
                            f"{string_literal(owner)})  # its gradient is summed with the last stage's copy")
            post_init.append(f"runtime.tie_across_stages(self.{op.attr_name}.weight, {string_literal(owner)}, "
                             f"copy=True{std_arg})  # a copy of the first stage's weight, kept equal")
        head = ['self.stages = [s for s in PIPELINE_STAGES if s["rank"] == pg.pp.rank]',
                'self.pre_process = any(s["pre_process"] for s in self.stages)',
                'self.post_process = any(s["post_process"] for s in self.stages)']
        init = head + (["if self.pre_process:"] + [f"    {ln}" for ln in pre_init] if pre_init else []) + block_init + \
            (["if self.post_process:"] + [f"    {ln}" for ln in post_init] if post_init else [])
        init = self._handles_used(init, body)
        body = (['if PIPELINE_STAGES[stage]["pre_process"]:'] + [f"    {ln}" for ln in pre_body] if pre_body else []) \
            + block_body + ['if not PIPELINE_STAGES[stage]["post_process"]:', f"    return {carry_out(block_body, carry)}"] \
            + post_body + ["return " + ", ".join(names.get(v) for v in outs)]
        params = [f"{carry}=None", "*", "stage"] + [f"{n}=None" for n in mdef.inputs]
        return init, body, params


class _Names:
    """Python variable names for values within one forward: spec names where possible, a suffix
    when a converted value would overwrite one still needed."""

    def __init__(self, inputs: list, values: list):
        self.of = dict(zip(values, inputs))
        self.holder = {n: v for v, n in self.of.items()}

    def get(self, vid: str) -> str:
        return self.of[vid]

    def bind(self, vid: str, base: str, index: int, last_use: dict, suffix: str = "") -> str:
        if vid in self.of:
            return self.of[vid]
        stem = f"{base}_{suffix}" if suffix else base
        # drawn one by one: most values take the first name, so never build the whole list
        candidates = itertools.chain([base] if not suffix else [], [stem], (f"{stem}_{n}" for n in range(2, 1000)))
        for name in candidates:
            held = self.holder.get(name)
            if held is None or last_use.get(held, -1) <= index:
                if not suffix or name != base:
                    self.of[vid] = name
                    self.holder[name] = vid
                    return name
        raise AssertionError("ran out of names")


def fit_lines(lines: list, trailing: dict) -> list:
    """Comments within WIDTH columns at the methods' indent: a trailing comment that runs past it
    moves to a line of its own above its code; a comment line past it wraps at spaces."""
    out = []
    for line in lines:
        text = line.lstrip(" ")
        pad = " " * (len(line) - len(text))
        if _INDENT + len(line) <= WIDTH:
            out.append(line)
        elif text in trailing:
            code, comment = trailing[text]
            out += _comment_lines(pad, comment) + [pad + code]
        elif text.startswith("# "):
            out += _comment_lines(pad, text[2:])
        else:
            out.append(line)  # code: its width is its own
    return out


def _comment_lines(pad: str, comment: str) -> list:
    width = WIDTH - _INDENT - len(pad) - 2
    return [f"{pad}# {part}" for part in textwrap.wrap(comment, width, break_long_words=False,
                                                       break_on_hyphens=False)]


def carry_out(block_body: list, carry: str) -> str:
    """The name the block's loop leaves its result in (`h = layer(h)`)."""
    last = block_body[-1].strip()
    return last.split(" = ", 1)[0] if " = " in last else carry


def _order_ties(init: list) -> list:
    """Construct the owners of shared weights before the layers that borrow them."""
    borrowers = [ln for ln in init if "weight=self." in ln]
    return [ln for ln in init if ln not in borrowers] + borrowers
