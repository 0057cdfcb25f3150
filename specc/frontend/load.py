"""Load a spec: read YAML with locations, follow `extends`, apply overrides, interpolate config,
and check structure, names, types and dataflow. Every failure is a located SpecError."""

from __future__ import annotations

import hashlib
import math
import os

from ..errors import Loc, SpecError, did_you_mean
from ..ops import SPEC_OPS
from .dataflow import check_identifier, parse_step
from .expr import has_interpolation, interpolate, unknown_name, whole_expression
from .hf_section import check_hf
from .megatron import check_megatron
from .model import Leaf, ModelInput, ModuleDef, Ref, Settings, Spec
from .module_checks import check_dataflow, check_module_graph
from .packed import thread_packed_inputs
from .yamlload import LDict, LList, LStr, check_keys, clip, kind_of, load_yaml, read_text

TOP_KEYS = {"name": "str", "description": "str", "extends": "str", "config": "mapping", "model": "mapping",
            "modules": "mapping", "hf": "mapping", "megatron": "mapping"}
MODEL_KEYS = {"module", "inputs"}
MODULE_KEYS = {"description", "inputs", "submodules", "forward", "recompute"}
RECOMPUTE = ("full", "selective")  # a module's `recompute:` (Megatron's granularities)
REF_KEYS = {"module", "repeat", "description", "modules", "pattern"}  # modules + pattern: a per-layer choice
LEAF_RESERVED = {"op", "impl", "description"}
IMPLS = ("auto", "native", "te", "flash", "unfused")
DTYPES = ("int64", "int32", "float32", "bfloat16", "float16")
MAX_EXTENDS = 16
MAX_REPEAT = 100_000
MAX_CONFIG_DEPTH = 64  # config values that refer to config values that refer to ...
MAX_SIZE = 1 << 40  # no tensor dimension or count is larger
MAX_NAME = 100  # characters in a spec name: it names files and folders (NAME_tp8_sp/, .NAME.tmp-XXXXXXXX)


def load_spec(path: str, settings: Settings = Settings(), overrides: list = ()) -> Spec:
    raw, texts = _read_with_extends(path, [])
    for key, value, loc in overrides:
        _apply_override(raw, key, value, loc)
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
    for key, value, _ in overrides:
        digest.update(f"\0{key}={value}".encode())
    # --reset-position-ids/--reset-attention-mask: the model takes position and document ids
    return thread_packed_inputs(_Builder(raw, path, settings, digest.hexdigest()).build())


# -- reading and extending -------------------------------------------------------------------

def read_spec(path: str) -> LDict:
    """The spec's merged document (after `extends`), unchecked beyond its top-level keys."""
    return _read_with_extends(path, [])[0]


def _read_with_extends(path: str, chain: list):
    norm = os.path.normpath(os.path.abspath(path))
    text = read_text(path)
    doc = load_yaml(text, path)
    if not isinstance(doc, LDict):
        raise SpecError(Loc(path, 1, 1), f"a spec must be a YAML mapping, got {kind_of(doc)}",
                        "start with keys such as 'name:', 'config:', 'model:' and 'modules:'")
    check_keys(doc, TOP_KEYS, "at the top level of the spec")
    texts = [text]
    if "extends" in doc:
        parent = doc["extends"]
        if not isinstance(parent, str) or not parent:
            raise SpecError(doc.value_loc("extends"), "'extends' must name a spec file", "e.g. extends: gpt.yaml")
        parent_path = os.path.normpath(os.path.join(os.path.dirname(path), parent))
        if not os.path.isfile(parent_path):
            raise SpecError(doc.value_loc("extends"), f"extended spec '{parent}' not found",
                            "paths are relative to this spec's folder")
        parent_norm = os.path.normpath(os.path.abspath(parent_path))
        if parent_norm in chain + [norm]:
            files = chain[chain.index(parent_norm):] + [norm] if parent_norm in chain else [norm]
            cycle = " -> ".join(os.path.basename(p) for p in files + [parent_norm])
            raise SpecError(doc.value_loc("extends"), f"cycle in 'extends': {cycle}",
                            "a spec may not extend itself, directly or through others")
        if len(chain) + 1 >= MAX_EXTENDS:
            raise SpecError(doc.value_loc("extends"), f"'extends' chain is longer than {MAX_EXTENDS} files")
        base, parent_texts = _read_with_extends(parent_path, chain + [norm])
        doc = _merge(base, doc)
        texts = parent_texts + texts
        doc.pop("extends", None)
    return doc, texts


def _merge(base, over, path=()):
    """Deep merge: mappings merge key by key, everything else is replaced by `over`. A module that
    brings its own `forward` replaces the parent's module whole: a new dataflow is a new module."""
    if not (isinstance(base, LDict) and isinstance(over, LDict)):
        return over
    if len(path) == 2 and path[0] == "modules" and "forward" in over:
        return over
    out = LDict(base)
    out.loc, out.key_locs, out.value_locs = over.loc, dict(base.key_locs), dict(base.value_locs)
    for key, value in over.items():
        out[key] = _merge(base[key], value, path + (key,)) if key in base else value
        out.key_locs[key] = over.key_locs[key]
        out.value_locs[key] = over.value_locs[key]
    return out


def _apply_override(raw: LDict, key: str, value, loc: Loc) -> None:
    """`--set name=value` sets a config value; `--set a.b.c=value` a path in the spec."""
    parts = key.split(".") if "." in key else ["config", key]
    node = raw
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node, LDict) or part not in node:
            where = ".".join(parts[: i + 1])
            raise SpecError(loc, f"'{where}' is not in the spec",
                            did_you_mean(part, node.keys() if isinstance(node, dict) else []))
        node = node[part]
    last = parts[-1]
    config_value = "." not in key
    # a config value must exist (a typo must not pass silently); a dotted path may add a key to a
    # mapping (e.g. `bias` to a linear that leaves it at its default), which validation then checks
    if not isinstance(node, LDict) or (config_value and last not in node):
        known = node.keys() if isinstance(node, dict) else []
        raise SpecError(loc, f"unknown {'config value' if config_value else 'key'} '{last}'", did_you_mean(last, known))
    node[last] = value
    node.key_locs.setdefault(last, loc)
    node.value_locs[last] = loc


# -- building the model ----------------------------------------------------------------------

def builtin_names(settings: Settings) -> dict:
    """The names every spec's `${...}` may use besides its config: the parallel settings."""
    return {"tensor_model_parallel_size": settings.tp, "micro_batch_size": settings.micro_batch_size,
            "sequence_parallel": settings.sp}


class _Builder:
    def __init__(self, raw: LDict, path: str, settings: Settings, digest: str):
        self.raw, self.path, self.settings, self.digest = raw, path, settings, digest
        self.config_raw = raw.get("config", LDict())
        self.resolved: dict = {}
        self.resolving: list = []

    def build(self) -> Spec:
        raw = self.raw
        for key in ("name", "model", "modules"):
            if key not in raw:
                raise SpecError(raw.loc, f"missing required key '{key}'", _REQUIRED_HINTS[key])
        name = self._str(raw, "name")
        check_identifier(name, raw.value_loc("name"), "spec name")
        if len(name) > MAX_NAME:
            raise SpecError(raw.value_loc("name"), f"spec name is {len(name)} characters long, at most {MAX_NAME}",
                            "it names the generated folder and files; choose a shorter name")
        if not isinstance(self.config_raw, LDict):
            raise SpecError(raw.value_loc("config"), f"'config' must be a mapping, got {kind_of(self.config_raw)}")
        for key in self.config_raw:
            check_identifier(key, self.config_raw.key_loc(key), "config name")
        config = {k: self.lookup(k, self.config_raw.key_loc(k)) for k in self.config_raw}
        modules_raw = raw["modules"]
        if not isinstance(modules_raw, LDict) or not modules_raw:
            raise SpecError(raw.value_loc("modules"), "'modules' must be a non-empty mapping of module names to definitions")
        modules = {}
        for mname, mraw in modules_raw.items():
            check_identifier(mname, modules_raw.key_loc(mname), "module name")
            modules[mname] = self._module(mname, mraw, modules_raw.value_loc(mname), modules_raw.key_loc(mname))
        root, inputs = self._model(raw["model"], raw.value_loc("model"), modules)
        check_module_graph(modules, root)
        desc = raw.get("description", "")
        if "hf" in raw:
            check_hf(raw["hf"], raw.value_loc("hf"), self.value)
        if "megatron" in raw:  # its form; the flags the command line owns: specc_cli/megatron_flags.py
            check_megatron(raw["megatron"], raw.value_loc("megatron"), self.config_raw)
        exprs = {k: e for k in self.config_raw if (e := whole_expression(self.config_raw[k])) is not None}
        return Spec(name, self.path, str(desc) if desc else "", config, modules, root, inputs, self.settings,
                    self.digest, raw.get("hf"), exprs)

    # -- config and interpolation --
    def _builtins(self) -> dict:
        return builtin_names(self.settings)

    def lookup(self, name: str, loc: Loc):
        builtins = self._builtins()
        if name in self.resolved:
            return self.resolved[name]
        if name not in self.config_raw:
            if name in builtins:
                return builtins[name]
            raise unknown_name(name, loc, list(self.config_raw) + list(builtins))
        if name in self.resolving:
            cycle = " -> ".join(self.resolving[self.resolving.index(name):] + [name])
            raise SpecError(self.config_raw.value_loc(name), f"config values refer to each other in a cycle: {cycle}")
        if len(self.resolving) >= MAX_CONFIG_DEPTH:
            raise SpecError(self.config_raw.value_loc(name), f"config values refer to each other more than "
                            f"{MAX_CONFIG_DEPTH} deep", "compute the value more directly")
        self.resolving.append(name)
        value = self.value(self.config_raw[name], self.config_raw.value_loc(name))
        self.resolving.pop()
        if isinstance(value, (LDict, dict)):
            raise SpecError(self.config_raw.value_loc(name), f"config value '{name}' must be a scalar or a list, not a mapping")
        self.resolved[name] = value
        return value

    def value(self, v, loc: Loc):
        if isinstance(v, str) and has_interpolation(v):
            start = v.loc_at(0) if isinstance(v, LStr) else loc
            return interpolate(v, start, self.lookup)
        if isinstance(v, LList):
            return [self.value(x, v.item_loc(i)) for i, x in enumerate(v)]
        return v

    def _str(self, d: LDict, key: str) -> str:
        v = self.value(d[key], d.value_loc(key))
        if not isinstance(v, str):
            raise SpecError(d.value_loc(key), f"'{key}' must be a string, got {kind_of(v)}")
        return v

    # -- modules --
    def _module(self, name: str, raw, loc: Loc, name_loc: Loc) -> ModuleDef:
        if not isinstance(raw, LDict):
            raise SpecError(loc, f"module '{name}' must be a mapping with 'submodules' and 'forward', got {kind_of(raw)}")
        check_keys(raw, MODULE_KEYS, f"in module '{name}'")
        for key in ("forward",):
            if key not in raw:
                raise SpecError(name_loc, f"module '{name}' is missing required key '{key}'",
                                "list its steps, e.g. forward: ['y = linear(x)', 'return y']")
        inputs = self._name_list(raw, "inputs", "input")
        subs_raw = raw.get("submodules", LDict())
        if not isinstance(subs_raw, LDict):
            raise SpecError(raw.value_loc("submodules"), f"'submodules' must be a mapping, got {kind_of(subs_raw)}",
                            "write one 'name: {op: ...}' or 'name: {module: ...}' per line, without '-'"
                            if isinstance(subs_raw, LList) else "")
        subs = {}
        for sname, sraw in subs_raw.items():
            check_identifier(sname, subs_raw.key_loc(sname), "submodule name")
            subs[sname] = self._submodule(sname, sraw, subs_raw.value_loc(sname))
            subs[sname].name_loc = subs_raw.key_loc(sname)
        steps_raw = raw["forward"]
        if not isinstance(steps_raw, LList) or not steps_raw:
            raise SpecError(raw.value_loc("forward"), "'forward' must be a non-empty list of steps",
                            "e.g. ['y = linear(x)', 'return y']")
        steps = [parse_step(s, steps_raw.item_loc(i)) for i, s in enumerate(steps_raw)]
        desc = raw.get("description", "")
        module = ModuleDef(name, inputs, subs, steps, [], raw.loc, str(desc) if desc else "")
        if "recompute" in raw:
            value = self.value(raw["recompute"], raw.value_loc("recompute"))
            if value not in RECOMPUTE:
                got = f"'{clip(value)}'" if isinstance(value, str) else kind_of(value)
                raise SpecError(raw.value_loc("recompute"), f"'recompute' must be one of {', '.join(RECOMPUTE)}, "
                                f"got {got}", did_you_mean(value, RECOMPUTE, listed=True) if isinstance(value, str) else
                                "full: recompute the whole module from its inputs; selective: its attention core")
            module.recompute, module.recompute_loc = value, raw.value_loc("recompute")
        check_dataflow(module)
        return module

    def _patterned(self, name: str, raw: LDict, repeat: int | None) -> Ref:
        """A repeated submodule whose layer i is the module `modules[pattern[i]]` (Megatron's hybrid
        override pattern "M-M*-", or a list of keys such as Hugging Face's layers_block_type)."""
        if "module" in raw:
            raise SpecError(raw.key_loc("module"), f"submodule '{name}' has both 'module' and 'modules'",
                            "one module for every layer: module; one per layer by a pattern: modules and pattern")
        for key, other in (("modules", "pattern"), ("pattern", "modules")):
            if key not in raw:
                raise SpecError(raw.key_loc(other), f"submodule '{name}' has '{other}' without '{key}'",
                                "modules: {M: MambaLayer, '*': AttentionLayer} picks layer i's module by pattern[i]")
        table = raw["modules"]
        if not isinstance(table, LDict) or not table:
            raise SpecError(raw.value_loc("modules"), f"'modules' must be a non-empty mapping of pattern keys to module "
                            f"names, got {kind_of(table)}", "e.g. modules: {M: MambaLayer, '*': AttentionLayer}")
        kinds = {str(k): self._str(table, k) for k in table}
        pattern = self.value(raw["pattern"], raw.value_loc("pattern"))
        at = raw.value_loc("pattern")
        if isinstance(pattern, str):
            keys = list(pattern)
        elif isinstance(pattern, list) and all(isinstance(k, str) for k in pattern):
            keys = list(pattern)
        else:
            raise SpecError(at, f"'pattern' must be a string (one character a layer) or a list of keys, got {kind_of(pattern)}")
        if not 1 <= len(keys) <= MAX_REPEAT:
            raise SpecError(at, f"'pattern' names {len(keys)} layers; it must name between 1 and {MAX_REPEAT}")
        for i, key in enumerate(keys):
            if key not in kinds:
                raise SpecError(at, f"pattern entry {clip(key)!r} (layer {i}) is not a key of 'modules'",
                                did_you_mean(key, kinds))
        if repeat is not None and repeat != len(keys):
            raise SpecError(raw.value_loc("repeat"), f"repeat={repeat}, but 'pattern' names {len(keys)} layers",
                            "leave repeat out: the pattern's length is the number of layers")
        layers = tuple(kinds[k] for k in keys)
        locs = {kinds[k]: table.value_loc(k) for k in table}
        return Ref(name, layers[0], len(layers), raw.value_loc("modules"), layer_modules=layers, module_locs=locs)

    def _name_list(self, raw: LDict, key: str, what: str) -> list:
        items = raw.get(key, LList())
        if not isinstance(items, LList):
            raise SpecError(raw.value_loc(key), f"'{key}' must be a list of names, got {kind_of(items)}",
                            f"e.g. {key}: [x, y]")
        seen = set()
        for i, n in enumerate(items):
            check_identifier(n, items.item_loc(i), what)
            if n in seen:
                raise SpecError(items.item_loc(i), f"duplicate {what} '{n}'")
            seen.add(n)
        return list(items)

    def _submodule(self, name: str, raw, loc: Loc):
        if not isinstance(raw, LDict):
            raise SpecError(loc, f"submodule '{name}' must be a mapping with 'op:' or 'module:', got {kind_of(raw)}")
        for ref in ("module", "modules"):
            if "op" in raw and ref in raw:
                raise SpecError(raw.key_loc(ref), f"submodule '{name}' has both 'op' and '{ref}'", "use one of them")
        if "module" in raw or "modules" in raw:
            check_keys(raw, REF_KEYS, f"in submodule '{name}'")
            repeat = None
            if "repeat" in raw:
                repeat = self._int(raw["repeat"], raw.value_loc("repeat"), "repeat")
                if not 1 <= repeat <= MAX_REPEAT:
                    raise SpecError(raw.value_loc("repeat"), f"repeat={repeat} must be between 1 and {MAX_REPEAT}")
            if "modules" in raw or "pattern" in raw:
                return self._patterned(name, raw, repeat)
            return Ref(name, self._str(raw, "module"), repeat, raw.value_loc("module"))
        if "op" not in raw:
            raise SpecError(raw.loc, f"submodule '{name}' needs 'op:' (an op from the registry) or 'module:' (a spec module)")
        op_name = self._str(raw, "op")
        if op_name not in SPEC_OPS:
            raise SpecError(raw.value_loc("op"), f"unknown op '{op_name}'", did_you_mean(op_name, SPEC_OPS))
        kind = SPEC_OPS[op_name]
        impl = self._str(raw, "impl") if "impl" in raw else "auto"
        locs = {"impl": raw.value_loc("impl")} if "impl" in raw else {}
        if impl not in IMPLS:
            raise SpecError(raw.value_loc("impl"), f"unknown impl '{impl}'", did_you_mean(impl, IMPLS))
        if impl != "auto" and impl not in kind.impls:
            raise SpecError(raw.value_loc("impl"), f"op '{op_name}' has no '{impl}' implementation",
                            "available: " + ", ".join(("auto",) + kind.impls))
        known = {a.name: a for a in kind.attrs}
        attrs, exprs = {}, {}
        for key in raw:
            if key in LEAF_RESERVED:
                continue
            if key not in known:
                raise SpecError(raw.key_loc(key), f"unknown attribute '{key}' for op '{op_name}'",
                                did_you_mean(key, list(known) + sorted(LEAF_RESERVED)))
            attrs[key] = self._attr(known[key], raw[key], raw.value_loc(key))
            locs[key] = raw.value_loc(key)
            if (expr := whole_expression(raw[key])) is not None:
                exprs[key] = (expr, attrs[key])
        for a in kind.attrs:
            if a.name not in attrs:
                if a.required:
                    raise SpecError(raw.loc, f"op '{op_name}' in submodule '{name}' is missing required attribute '{a.name}'",
                                    a.doc or f"add '{a.name}: ...'")
                attrs[a.name] = a.default
        return Leaf(name, op_name, impl, attrs, locs, raw.loc, attr_exprs=exprs)

    def _attr(self, attr, raw, loc: Loc):
        value = self.value(raw, loc)
        if attr.type == "int":
            value = self._int(value, loc, attr.name, evaluated=True)
        elif attr.type == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                got = f"the string '{clip(value)}'" if isinstance(value, str) else kind_of(value)
                raise SpecError(loc, f"'{attr.name}' must be a number, got {got}", _number_hint(value))
            value = float(value)
            if not math.isfinite(value):
                raise SpecError(loc, f"'{attr.name}' must be a finite number, got {value}")
        elif attr.type == "bool":
            if not isinstance(value, bool):
                got = f"the string '{clip(value)}'" if isinstance(value, str) else kind_of(value)
                raise SpecError(loc, f"'{attr.name}' must be true or false, got {got}", "write true or false, unquoted")
        elif attr.type == "str":
            if not isinstance(value, str):
                raise SpecError(loc, f"'{attr.name}' must be a string, got {kind_of(value)}")
            value = str(value)
            if attr.choices and value not in attr.choices:
                raise SpecError(loc, f"'{attr.name}' must be one of {', '.join(attr.choices)}, got '{value}'",
                                did_you_mean(value, attr.choices, listed=True))
        elif attr.type == "int_list":
            if not isinstance(value, list) or not value:
                raise SpecError(loc, f"'{attr.name}' must be a non-empty list of integers, got {kind_of(value)}")
            items = raw if isinstance(raw, LList) else None
            out = []
            for i, x in enumerate(value):
                where = items.item_loc(i) if items is not None and len(items) == len(value) else loc
                x = self._int(x, where, attr.name, evaluated=True)
                low = 1 if attr.minimum is None else attr.minimum  # sizes by default; an op may allow 0
                if x < low:
                    raise SpecError(where, f"'{attr.name}' entries must be {'positive' if low == 1 else f'at least {low}'}, "
                                    f"got {x}")
                out.append(x)
            value = tuple(out)
        elif attr.type == "float_list":
            if not isinstance(value, list) or not value:
                raise SpecError(loc, f"'{attr.name}' must be a non-empty list of numbers, got {kind_of(value)}")
            bad = [x for x in value if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)]
            if bad:
                raise SpecError(loc, f"'{attr.name}' entries must be finite numbers, got {clip(bad[0])}")
            value = tuple(float(x) for x in value)
        if attr.minimum is not None and isinstance(value, (int, float)) and value < attr.minimum:
            raise SpecError(loc, f"'{attr.name}' must be at least {attr.minimum}, got {value}")
        return value

    def _int(self, raw, loc: Loc, what: str, evaluated: bool = False) -> int:
        value = raw if evaluated else self.value(raw, loc)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            got = f"the string '{clip(value)}'" if isinstance(value, str) else kind_of(value)
            raise SpecError(loc, f"'{what}' must be an integer, got {got}", _number_hint(value))
        if isinstance(value, float):
            if not value.is_integer():
                raise SpecError(loc, f"'{what}' must be an integer, got {value:g}", "sizes must divide evenly; use // for integer division")
            value = int(value)
        if abs(value) > MAX_SIZE:
            raise SpecError(loc, f"'{what}' is too large: {value:.3g}", f"at most 2**40 = {MAX_SIZE}")
        return value

    # -- the root --
    def _model(self, raw, loc: Loc, modules: dict):
        if not isinstance(raw, LDict):
            raise SpecError(loc, f"'model' must be a mapping with 'module' and 'inputs', got {kind_of(raw)}")
        check_keys(raw, MODEL_KEYS, "in 'model'")
        if "module" not in raw:
            raise SpecError(raw.loc, "'model' is missing 'module'", "name the root module, e.g. module: GPTModel")
        root = self._str(raw, "module")
        if root not in modules:
            raise SpecError(raw.value_loc("module"), f"undefined module '{root}'", did_you_mean(root, modules))
        decl = raw.get("inputs", LDict())
        if not isinstance(decl, LDict):
            raise SpecError(raw.value_loc("inputs"), "'model.inputs' must map each root input to {shape: [...], dtype: ...}")
        inputs = []
        want = modules[root].inputs
        for name in decl:
            if name not in want:
                raise SpecError(decl.key_loc(name), f"'{name}' is not an input of module '{root}'", did_you_mean(name, want))
        for name in want:
            if name not in decl:
                raise SpecError(raw.value_loc("inputs") if "inputs" in raw else raw.loc, f"root input '{name}' of module '{root}' has no declared shape",
                                f"add '{name}: {{shape: [micro_batch_size, seq_length], dtype: int64}}' under model.inputs")
            inputs.append(self._input(name, decl[name], decl.value_loc(name)))
        return root, inputs

    def _input(self, name: str, raw, loc: Loc) -> ModelInput:
        if not isinstance(raw, LDict):
            raise SpecError(loc, f"input '{name}' must be a mapping {{shape: [...], dtype: ...}}")
        check_keys(raw, {"shape", "dtype"}, f"in input '{name}'")
        if "shape" not in raw:
            raise SpecError(raw.loc, f"input '{name}' is missing 'shape'")
        shape_raw = raw["shape"]
        if not isinstance(shape_raw, LList) or not shape_raw:
            raise SpecError(raw.value_loc("shape"), f"'shape' must be a non-empty list, got {kind_of(shape_raw)}")
        dims = []
        for i, d in enumerate(shape_raw):
            dloc = shape_raw.item_loc(i)
            if isinstance(d, str) and not has_interpolation(d):
                if not d.isidentifier() or (d not in self.config_raw and d not in self._builtins()):
                    raise SpecError(dloc, f"shape entry '{clip(d)}' is not a config name",
                                    did_you_mean(d, list(self.config_raw) + list(self._builtins())))
                d = self.lookup(d, dloc)
            d = self._int(self.value(d, dloc), dloc, "shape", evaluated=True)
            if d < 1:
                raise SpecError(dloc, f"shape dims must be positive, got {d}")
            dims.append(d)
        dtype = self._str(raw, "dtype") if "dtype" in raw else "int64"
        if dtype not in DTYPES:
            raise SpecError(raw.value_loc("dtype"), f"unknown dtype '{dtype}'", did_you_mean(dtype, DTYPES))
        return ModelInput(name, tuple(dims), dtype, raw.loc)


_REQUIRED_HINTS = {
    "name": "add 'name: my_model'",
    "model": "add 'model: {module: RootModule, inputs: {...}}'",
    "modules": "add 'modules:' with at least the root module",
}


def _number_hint(value) -> str:
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return "write a number or ${expression}"
    if getattr(value, "quoted", False):
        return "write it without quotes"
    if "e" in value.lower():  # YAML 1.1 floats need a dot and a signed exponent
        return f"YAML reads '{value}' as a string: write exponents with a dot and a sign, e.g. 1.0e-5 or 6.4e+1"
    return "write a number or ${expression}"
