"""Megatron Core checkpoints <-> specc checkpoints, driven by the mapping a spec declares under
`megatron.checkpoint` (docs/checkpoints.md):

    megatron:
      checkpoint:
        params:
          - {specc: embedding.weight, megatron: embedding.word_embeddings.weight}
          - specc: "layers.{i}.self_attention.linear_qkv.weight"        # {i}: a layer index
            megatron: "decoder.layers.{i}.self_attention.linear_qkv.weight"
            permute: {groups: "${num_query_groups}", sections: [...]}   # Megatron's rows per query group
        ignore: [...]                                                   # Megatron tensors not imported
        extra_state: ["decoder.layers.{i}.self_attention.linear_qkv", ...]  # modules with an _extra_state

Nothing here knows a model family. What is Megatron's and not the spec's lives in files.py: the
folders, the layer stacking of torch_dist, the legacy per-rank files. A legacy checkpoint's TP
shards are joined the way the spec's parameter is sharded, which is Megatron's too: along its
shard dim, segment by segment for a fused parameter ([gate_r | up_r] on rank r), and in one piece
for a `permute`d one (rank r holds whole query groups). Optimizer state: Adam's moments (and
fp32 master weights) are per parameter at its shape in Megatron's non-distributed optimizer and in
its distributed optimizer's model-space layouts (optimizer.state.exp_avg.NAME, ...), so they go
through the same names and row permutations as the weights; the step count and param_groups are
in the common state (read_weights, optimizer_common).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

import torch

from runtime.checkpoint import read_info, read_optimizer_tensors, read_tensors, resolve, save_tensors
from runtime.checkpoint.core import check_params, check_spec
from specc.errors import Loc, SpecError, did_you_mean
from specc.frontend.load import read_spec

from ..hf.convert import model_params
from ..hf.files import fresh_output
from ..hf.layouts import grouped_to_sections, sections_to_grouped
from ..hf.mapping import _evaluate
from .files import (
    MegatronError,
    checkpoint_format,
    dist_tensors,
    iteration_dir,
    read_common,
    read_dist,
    read_legacy,
    write_dist,
)


@dataclass
class Entry:
    specc: str  # a name pattern; {i} is a layer index
    megatron: str
    permute: tuple | None  # (groups, sections): Megatron's rows are groups of [s0 | s1 | ...]
    loc: Loc

    def regex(self) -> re.Pattern:
        return re.compile(re.escape(self.specc).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


def mapping_of(spec_path: str, spec) -> tuple[list, list, list]:
    """(entries, ignore patterns, extra_state module patterns) of the spec's
    megatron.checkpoint; a SpecError when it has none."""
    raw = read_spec(spec_path).get("megatron")
    block = raw.get("checkpoint") if hasattr(raw, "get") else None
    if not block or not block.get("params"):
        raise SpecError(Loc(spec_path), f"spec {spec.name} declares no Megatron checkpoint mapping "
                        "('megatron: checkpoint: params:')", "see docs/checkpoints.md; specs/llama.yaml has one")
    entries = []
    for raw_entry in block["params"]:
        permute = None
        if raw_entry.get("permute") is not None:
            p = _evaluate(raw_entry["permute"], raw_entry.value_loc("permute"), spec)
            permute = (int(p["groups"]), tuple(int(x) for x in p["sections"]))
        entries.append(Entry(str(raw_entry["specc"]), str(raw_entry["megatron"]), permute,
                             raw_entry.value_loc("specc")))
    return entries, [str(x) for x in block.get("ignore") or []], [str(x) for x in block.get("extra_state") or []]


def bind(entries: list, names, spec_name: str, loc: Loc) -> dict:
    """{specc parameter: (entry, megatron name)}: every parameter mapped once, every entry used."""
    names = list(names)
    bound, used = {}, set()
    for entry in entries:
        regex = entry.regex()
        for name in names:
            m = regex.match(name)
            if not m:
                continue
            if name in bound:
                raise SpecError(entry.loc, f"parameter '{name}' is mapped by both '{bound[name][0].specc}' and "
                                f"'{entry.specc}'")
            index = m.groupdict().get("i")
            bound[name] = (entry, entry.megatron.replace("{i}", index) if index is not None else entry.megatron)
            used.add(id(entry))
    for entry in entries:
        if id(entry) not in used:
            raise SpecError(entry.loc, f"'{entry.specc}' matches no parameter of model {spec_name}",
                            did_you_mean(entry.specc.replace("{i}", "0"), names) or "is this mapping meant for this spec?")
    missing = [n for n in names if n not in bound]
    if missing:
        raise SpecError(loc, f"the megatron checkpoint mapping has no entry for parameter '{missing[0]}'"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                        "add - {specc: NAME, megatron: MEGATRON_NAME} to megatron.checkpoint.params")
    return bound


def _matches(patterns: list, name: str) -> bool:
    return any(re.match(re.escape(p).replace(re.escape("{i}"), r"\d+") + "$", name) for p in patterns)


def _vocab_hint(spec, shape, want) -> str:
    vocab = spec.config.get("vocab_size")
    if len(shape) == len(want) and shape[1:] == tuple(want[1:]) and want[0] == vocab:
        return (f" (Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP: "
                f"--set vocab_size={shape[0]})")
    return ""


# -- reading -----------------------------------------------------------------------------------------

def _join_legacy(shards: list, meta, entry) -> torch.Tensor:
    """One parameter's TP shards (rank order) of a legacy checkpoint, joined at full size."""
    if len(shards) == 1 or meta.shard_dim is None:
        return shards[0]
    dim = meta.shard_dim
    if entry.permute is None and len(meta.segments) > 1:
        t = len(shards)
        pieces = [s.split([n // t for n in meta.segments], dim=dim) for s in shards]
        return torch.cat([torch.cat([p[k] for p in pieces], dim=dim) for k in range(len(meta.segments))], dim=dim)
    return torch.cat(shards, dim=dim)


def read_weights(load_dir: str, spec_path: str, overrides: dict | None = None, iteration: int | None = None,
                 optimizer_state: bool = False) -> dict:
    """A Megatron checkpoint's weights as the spec's full tensors: {"tensors", "iteration",
    "format", "optimizer" (whether it holds optimizer state), "path", "consumed_samples" (its
    args', or None)}; with `optimizer_state`, also "optimizer_state": {"step", "states":
    {state: {parameter: full tensor}}} (Adam's exp_avg and exp_avg_sq, "master" from Megatron's
    fp32_param), mapped as the weights are, or None where the checkpoint has none. A layout of
    optimizer state that is not read is a MegatronError (optimizer_layout)."""
    spec, identity, params = model_params(spec_path, overrides)
    entries, ignore, _extra = mapping_of(spec_path, spec)
    bound = bind(entries, params, spec.name, Loc(spec_path))
    path, it = iteration_dir(load_dir, iteration)
    fmt = checkpoint_format(path)
    states, step, consumed = {}, None, None
    if fmt == "torch_dist":
        available = dist_tensors(path)
        objects = available.pop(None)
        optimizer = any(k.startswith("optimizer.") for k in available) or any(o.startswith("optimizer.") for o in objects)
        common = read_common(path)
        optimizer = optimizer or common.get("optimizer") is not None
        consumed = getattr(common.get("args"), "consumed_train_samples", None)
        moments = {k: v for k, v in available.items() if k.startswith("optimizer.")}
        available = {k: v for k, v in available.items() if not k.startswith("optimizer.")}
        for name, (entry, mname) in bound.items():
            if mname not in available:
                raise MegatronError(f"{path}: no tensor {mname} (for {spec.name}'s {name})")
            shape = tuple(available[mname][2])
            if entry.permute is None and shape != tuple(params[name].full_shape):
                raise MegatronError(f"{path}: {mname} is {list(shape)} in the checkpoint, but spec {spec.name}'s {name} "
                                    f"is {list(params[name].full_shape)}{_vocab_hint(spec, shape, params[name].full_shape)}")
        wanted = {mname: available[mname] for _e, mname in bound.values()}
        if optimizer_state and optimizer:
            optimizer_layout(path, common, objects)
            step = optimizer_step(path, common.get("optimizer"))
            for state in sorted({k.split(".")[2] for k in moments}):
                for name, (_entry, mname) in bound.items():
                    key = f"optimizer.state.{state}.{mname}"
                    if key not in moments:
                        raise MegatronError(f"{path}: its optimizer state has no {key} (for {spec.name}'s {name})")
                    if tuple(moments[key][2]) != tuple(available[mname][2]):
                        raise MegatronError(f"{path}: {key} is {list(moments[key][2])}, but {mname} is "
                                            f"{list(available[mname][2])}")
                    wanted[key] = moments[key]
                states[state] = {name: f"optimizer.state.{state}.{mname}" for name, (_e, mname) in bound.items()}
            if not states:
                raise MegatronError(f"{path}: its optimizer state holds no per-parameter tensors (optimizer.state.*)")
        got = read_dist(path, wanted)
        used = {mname for _e, mname in bound.values()}
    else:
        shards, optimizer = read_legacy(path)
        if optimizer_state and optimizer:
            raise MegatronError(f"{path}: the optimizer state of Megatron's legacy torch format is not read (it is "
                                "pickled per rank in its own buffers' order): load with --no-load-optim or --finetune, "
                                "or save it from Megatron with --ckpt-format torch_dist")
        tps = sorted({tp for tp, _pp in shards})
        available = {}
        for (tp, pp), model in sorted(shards.items()):
            for k, v in model.items():
                available.setdefault(k, {})[tp] = v
        got = {}
        for name, (entry, mname) in bound.items():
            if mname not in available:
                raise MegatronError(f"{path}: no tensor {mname} (for {spec.name}'s {name})")
            pieces = [available[mname].get(tp) for tp in tps]
            if any(p is None for p in pieces):
                raise MegatronError(f"{path}: {mname} is missing on a tensor-parallel rank")
            got[mname] = _join_legacy(pieces, params[name], entry)
        used = set(got)
    extra = sorted(k for k in available if k not in used and not k.endswith("_extra_state") and not _matches(ignore, k))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise MegatronError(f"{path}: tensor {extra[0]}{more} is not in spec {spec.name}'s megatron checkpoint "
                            "mapping (map it, or list it under megatron.checkpoint.ignore)")
    def to_spec(name, entry, mname, t):
        want = tuple(params[name].full_shape)
        if entry.permute is not None:  # Megatron's rows per query group (the moments' too)
            groups, sections = entry.permute
            if t.dim() == 0 or t.shape[0] != groups * sum(sections) or tuple(t.shape[1:]) != want[1:]:
                raise MegatronError(f"{path}: {mname} is {list(t.shape)} in the checkpoint, but spec {spec.name}'s "
                                    f"{name} is {list(want)} ({groups} query groups of {sum(sections)} rows)")
            t = grouped_to_sections(t, groups, sections)
        if tuple(t.shape) != want:
            raise MegatronError(f"{path}: {mname} is {list(t.shape)} in the checkpoint, but spec {spec.name}'s {name} is "
                                f"{list(want)}{_vocab_hint(spec, tuple(t.shape), want)}")
        return t.contiguous()

    tensors = {name: to_spec(name, entry, mname, got[mname]) for name, (entry, mname) in bound.items()}
    opt = None
    if states:
        opt = {"step": step, "states": {MEGATRON_STATES.get(state, state): {
            name: to_spec(name, bound[name][0], key, got[key]) for name, key in keys.items()}
            for state, keys in states.items()}, "hyper": optimizer_hyper(common.get("optimizer"))}
    return {"tensors": tensors, "iteration": it, "format": fmt, "optimizer": optimizer, "path": path,
            "spec": spec, "identity": identity, "optimizer_state": opt,
            "consumed_samples": consumed if isinstance(consumed, int) else None}


# Megatron's per-parameter optimizer state names that differ from runtime.optim's: the fp32 master
# weights are fp32_param (non-distributed) or param (the distributed optimizer's fully_reshardable)
MEGATRON_STATES = {"fp32_param": "master", "param": "master"}
# its distributed optimizer's layouts whose state is per parameter at the model's shapes (as the
# non-distributed optimizers'); the others keep flat per-data-parallel-rank buffers
MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space")


def _find(obj, key: str) -> list:
    """Every value under `key` in nested dicts and lists."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                out.append(v)
            out += _find(v, key)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += _find(v, key)
    return out


def optimizer_layout(path: str, common: dict, objects: list) -> str:
    """The layout of a torch_dist checkpoint's optimizer state: 'non-distributed' or one of the
    distributed optimizer's model-space layouts (MODEL_SPACE), which are read; any other is a
    one-line MegatronError naming it."""
    meta = common.get("content_metadata") if isinstance(common.get("content_metadata"), dict) else {}
    kinds = [meta.get("distrib_optim_sharding_type")] + _find(common.get("optimizer"), "param_state_sharding_type")
    kinds = sorted({str(k) for k in kinds if k})
    if not kinds and any(o.startswith("optimizer.distributed.") for o in objects):
        kinds = ["dp_reshardable"]
    other = [k for k in kinds if k not in MODEL_SPACE]
    if other:
        raise MegatronError(f"{path}: its optimizer state is Megatron's distributed optimizer in the '{other[0]}' "
                            "layout (flat buffers per data-parallel rank), which is not read: load with --no-load-optim "
                            "(or --finetune), or save it from Megatron with --dist-ckpt-optim-fully-reshardable")
    return kinds[0] if kinds else "non-distributed"


def optimizer_hyper(optimizer) -> dict | None:
    """The run's Adam settings as specc's OptimizerConfig names them, from the param_groups in
    the common state (the decayed group's, else the first): what an export writes back."""
    groups = [g for gs in _find(optimizer, "param_groups") if isinstance(gs, list) for g in gs if isinstance(g, dict)]
    groups.sort(key=lambda g: -float(g.get("wd_mult", 1.0) or 0.0))
    if not groups or not isinstance(groups[0].get("betas"), (tuple, list)):
        return None
    g = groups[0]
    mult = float(g.get("wd_mult", 1.0) or 1.0)
    return {"lr": float(g.get("max_lr") if g.get("max_lr") is not None else g["lr"]),
            "min_lr": float(g.get("min_lr") or 0.0), "weight_decay": float(g.get("weight_decay", 0.0)) / mult,
            "adam_beta1": float(g["betas"][0]), "adam_beta2": float(g["betas"][1]), "adam_eps": float(g.get("eps", 1e-8)),
            "lr_now": float(g.get("lr", 0.0)), "decoupled_lr": None}


def optimizer_step(path: str, optimizer) -> int:
    """Adam's step count in the common state: the non-distributed optimizers' common_step, or
    the distributed optimizer's param_groups' step; every one found the same."""
    steps = _find(optimizer, "common_step")
    if not steps:
        steps = [s for groups in _find(optimizer, "param_groups") for s in _find(groups, "step")]
    values = {int(s.item()) if isinstance(s, torch.Tensor) else int(s) for s in steps
              if isinstance(s, (int, float, torch.Tensor)) and not isinstance(s, bool)}
    if len(values) != 1:
        raise MegatronError(f"{path}: its optimizer state has " + ("no step count (common_step)" if not values else
                            f"differing step counts {sorted(values)}"))
    return values.pop()


def import_megatron(load_dir: str, spec_path: str, out: str, overrides: dict | None = None,
                    iteration: int | None = None, optimizer_state: bool = True, resume: bool = True) -> dict:
    """A Megatron checkpoint (its save directory's latest, `iteration`, or one iter_N/ folder)
    into a new specc checkpoint OUT at step N: its weights; with `resume` (where its args say how
    many samples were consumed) the data position and the schedule's iteration; with
    `optimizer_state` (and `resume`) its optimizer state where it has some (read_weights), the
    fp32 weights standing for the master weights where Megatron trained in fp32. The summary says
    what came over."""
    fresh_output(out)
    read = read_weights(load_dir, spec_path, overrides, iteration, optimizer_state=optimizer_state and resume)
    step = read["iteration"] or 0
    identity = read["identity"]
    data = {"consumed_samples": read["consumed_samples"]} if resume and read["consumed_samples"] is not None else None
    optimizer = None
    if read["optimizer_state"] is not None and data is not None:
        states = dict(read["optimizer_state"]["states"])
        states.setdefault("master", {n: t.float() for n, t in read["tensors"].items()})
        optimizer = {"step": read["optimizer_state"]["step"], **states}
    path = save_tensors(out, step, read["tensors"], spec_sha256=identity["sha256"], spec_name=identity["name"],
                        optimizer=optimizer, data_state=data,
                        scheduler_state={"iteration": step} if data is not None else None,
                        config={"megatron_import": {"from": os.path.abspath(read["path"]), "format": read["format"],
                                                    "iteration": read["iteration"], "spec": spec_path,
                                                    "overrides": dict(overrides or {})},
                                # Megatron's Adam settings (its param_groups): what an export of it writes back
                                **({"optimizer": read["optimizer_state"]["hyper"]}
                                   if optimizer and read["optimizer_state"]["hyper"] else {})})
    return {"path": path, "step": step, "format": read["format"], "optimizer": read["optimizer"],
            "optimizer_state": sorted(k for k in (optimizer or {}) if k != "step") or None,
            "optimizer_step": optimizer["step"] if optimizer else None, "data": data,
            "tensors": len(read["tensors"]), "parameters": sum(t.numel() for t in read["tensors"].values()),
            "spec": identity["name"]}


# -- writing -----------------------------------------------------------------------------------------

def megatron_tensors(full: dict, spec_path: str, spec, params: dict) -> tuple[dict, list]:
    """({megatron name: tensor}, [modules with an _extra_state]) of the spec's full tensors."""
    entries, _ignore, extra = mapping_of(spec_path, spec)
    bound = bind(entries, params, spec.name, Loc(spec_path))
    tensors = {}
    for name, (entry, mname) in bound.items():
        t = full[name]
        if entry.permute is not None:
            t = sections_to_grouped(t, *entry.permute)
        tensors[mname] = t.contiguous().clone()
    layers = sorted({m.group(1) for n in params if (m := re.match(r"^(?:.*\.)?layers\.(\d+)\.", n))}, key=int)
    modules = []
    for pattern in extra:
        modules += [pattern.replace("{i}", i) for i in layers] if "{i}" in pattern else [pattern]
    return tensors, modules


def megatron_export_tensors(ckpt: str, spec_path: str, overrides: dict | None = None, step: int | None = None,
                            allow_spec_change: bool = False, optimizer: dict | None = None) -> dict:
    """What an export writes, read from a specc checkpoint: {"tensors" (Megatron's names),
    "modules" (with an _extra_state), "step", "spec", "common" (Megatron's common state: the
    optimizer's step and param_groups), "optimizer" (what of it was written, or why not)}.
    optimizer: the run's OptimizerConfig as a dict (lr, min_lr, weight_decay, adam_beta1/2,
    adam_eps, decoupled_lr) and "lr_now" (the schedule's lr at the step), to write the
    checkpoint's Adam state as Megatron's non-distributed optimizer does (optimizer_common); None:
    weights only. Under torch.distributed every rank calls it (the checkpoint's DCP read is
    collective), and every rank gets the full tensors."""
    spec, identity, params = model_params(spec_path, overrides)
    bind(mapping_of(spec_path, spec)[0], params, spec.name, Loc(spec_path))  # a spec without one: said first
    path = resolve(ckpt, step)
    info = read_info(path)
    check_spec(path, info["spec"], identity, allow_spec_change)
    check_params(path, info["params"], {n: {"shape": list(m.full_shape)} for n, m in params.items()})
    tensors, modules = megatron_tensors(read_tensors(path, list(params)), spec_path, spec, params)
    common, written = {}, "weights only: the checkpoint has no optimizer state"
    if info.get("optimizer") is not None and optimizer is None:
        written = "weights only: the checkpoint records no Adam settings (lr, betas, eps, weight decay) to write"
    elif info.get("optimizer") is not None:
        state = read_optimizer_tensors(path)
        written = _optimizer_refusal(state, optimizer, params, info)
        if written is None:
            sixteen = any(d["dtype"] in ("bfloat16", "float16") for d in info["params"].values())
            names = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
            if sixteen:  # Megatron's 16-bit optimizer keeps fp32 masters (fp32_param); its fp32 one none
                names["master"] = "fp32_param"
            for ours, theirs in names.items():
                mapped, _ = megatron_tensors(state[ours], spec_path, spec, params)
                tensors.update({f"optimizer.state.{theirs}.{k}": v for k, v in mapped.items()})
            common = optimizer_common(int(state["step"]), optimizer, tensors, sixteen)
            written = f"Adam state at step {int(state['step'])} ({', '.join(names.values())})"
    return {"tensors": tensors, "modules": modules, "step": info["step"], "spec": identity["name"], "common": common,
            "optimizer": written}


def _optimizer_refusal(state, optimizer: dict, params: dict, info: dict) -> str | None:
    """Why a checkpoint's optimizer state is not written for Megatron (None: it is)."""
    if state is None:
        return "weights only: the checkpoint has no optimizer state"
    if not all(n in state.get(k, {}) for k in ("exp_avg", "exp_avg_sq") for n in params):
        return "weights only: its optimizer state is not Adam's (exp_avg, exp_avg_sq of every parameter)"
    if any(".experts." in n for n in params):
        return ("weights only: Megatron groups a MoE model's Adam state by its expert-parallel size (a second, "
                "chained optimizer for the experts at EP > 1), which the checkpoint does not say")
    if optimizer.get("decoupled_lr") is not None:
        return "weights only: --decoupled-lr's parameter groups are not written"
    if any(d["dtype"] in ("bfloat16", "float16") for d in info["params"].values()) and "master" not in state:
        return "weights only: 16-bit weights without fp32 master weights"
    return None


# the content metadata Megatron's training loop saves with a checkpoint of its non-distributed optimizer
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def optimizer_common(step: int, optimizer: dict, tensors: dict, sixteen_bit: bool) -> dict:
    """The common state of Megatron's non-distributed Adam (FP32Optimizer, or under
    Float16OptimizerWithFloat16Params one level down): the step as common_step and the
    param_groups its load pairs with its own by (wd_mult, lr_mult, max_lr, min_lr, ...): a group
    of matrices (wd_mult 1) and one of biases and vectors (wd_mult 0), as get_megatron_optimizer
    makes them; torch's AdamW takes lr, betas, eps and weight_decay from them."""
    mults = sorted({0.0 if (t.dim() == 1 or k.endswith(".bias")) else 1.0
                    for k, t in tensors.items() if not k.startswith("optimizer.")}, reverse=True)
    # a stacked layer weight is per layer here (decoder.layers.N.X): its own dims decide
    groups = [{"is_expert_parallel": False, "default_config": True, "wd_mult": m, "lr_mult": 1.0,
               "is_decoupled_lr": False, "max_lr": float(optimizer["lr"]), "min_lr": float(optimizer["min_lr"]),
               "lr": float(optimizer.get("lr_now", optimizer["lr"])),
               "betas": (float(optimizer["adam_beta1"]), float(optimizer["adam_beta2"])),
               "eps": float(optimizer["adam_eps"]), "weight_decay": float(optimizer["weight_decay"]) * m,
               "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None, "decoupled_weight_decay": True} for m in mults]
    inner = {"state": {"common_step": torch.tensor(float(step))}, "param_groups": groups}
    return {"optimizer": {"optimizer": inner} if sixteen_bit else inner, "content_metadata": dict(CONTENT_METADATA)}


def export_megatron(ckpt: str, spec_path: str, out: str, overrides: dict | None = None, step: int | None = None,
                    allow_spec_change: bool = False) -> dict:
    """A specc checkpoint (any layout saved it) as a new Megatron Core torch_dist save directory
    OUT: iter_N/ (N its step) and latest_checkpointed_iteration.txt; its weights, and its Adam
    state as Megatron's non-distributed optimizer saves it where the checkpoint has one (with the
    settings of the run that saved it, in its config; the summary's "optimizer" says what)."""
    fresh_output(out)
    config = read_info(resolve(ckpt, step)).get("config") or {}
    optimizer = config.get("optimizer") if isinstance(config.get("optimizer"), dict) else None
    got = megatron_export_tensors(ckpt, spec_path, overrides, step, allow_spec_change, optimizer=optimizer)
    tensors = got["tensors"]
    created = not os.path.lexists(out)
    try:
        written = write_dist(out, got["step"], tensors, got["modules"], got["common"])
    except BaseException:
        if created:  # nothing half-written is left: the folder goes too
            shutil.rmtree(out, ignore_errors=True)
        raise
    weights = [t for k, t in tensors.items() if not k.startswith("optimizer.")]
    return {"path": written, "step": got["step"], "tensors": len(weights),
            "parameters": sum(t.numel() for t in weights), "spec": got["spec"], "optimizer": got["optimizer"]}
