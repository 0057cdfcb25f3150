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
for a `permute`d one (rank r holds whole query groups). Weights only: optimizer state is not
converted (see import_megatron).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

import torch

from runtime.checkpoint import read_info, read_tensors, resolve, save_tensors
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


def read_weights(load_dir: str, spec_path: str, overrides: dict | None = None, iteration: int | None = None) -> dict:
    """A Megatron checkpoint's weights as the spec's full tensors: {"tensors", "iteration",
    "format", "optimizer" (whether it holds optimizer state, which is not read), "path"}."""
    spec, identity, params = model_params(spec_path, overrides)
    entries, ignore, _extra = mapping_of(spec_path, spec)
    bound = bind(entries, params, spec.name, Loc(spec_path))
    path, it = iteration_dir(load_dir, iteration)
    fmt = checkpoint_format(path)
    if fmt == "torch_dist":
        available = dist_tensors(path)
        objects = available.pop(None)
        optimizer = any(k.startswith("optimizer.") for k in available) or any(o.startswith("optimizer.") for o in objects)
        available = {k: v for k, v in available.items() if not k.startswith("optimizer.")}
        for name, (entry, mname) in bound.items():
            if mname not in available:
                raise MegatronError(f"{path}: no tensor {mname} (for {spec.name}'s {name})")
            shape = tuple(available[mname][2])
            if entry.permute is None and shape != tuple(params[name].full_shape):
                raise MegatronError(f"{path}: {mname} is {list(shape)} in the checkpoint, but spec {spec.name}'s {name} "
                                    f"is {list(params[name].full_shape)}{_vocab_hint(spec, shape, params[name].full_shape)}")
        got = read_dist(path, {mname: available[mname] for _e, mname in bound.values()})
        used = set(got)
    else:
        shards, optimizer = read_legacy(path)
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
    tensors = {}
    for name, (entry, mname) in bound.items():
        t, want = got[mname], tuple(params[name].full_shape)
        if entry.permute is not None:
            groups, sections = entry.permute
            if t.dim() == 0 or t.shape[0] != groups * sum(sections) or tuple(t.shape[1:]) != want[1:]:
                raise MegatronError(f"{path}: {mname} is {list(t.shape)} in the checkpoint, but spec {spec.name}'s "
                                    f"{name} is {list(want)} ({groups} query groups of {sum(sections)} rows)")
            t = grouped_to_sections(t, groups, sections)
        if tuple(t.shape) != want:
            raise MegatronError(f"{path}: {mname} is {list(t.shape)} in the checkpoint, but spec {spec.name}'s {name} is "
                                f"{list(want)}{_vocab_hint(spec, tuple(t.shape), want)}")
        tensors[name] = t.contiguous()
    return {"tensors": tensors, "iteration": it, "format": fmt, "optimizer": optimizer, "path": path,
            "spec": spec, "identity": identity}


def import_megatron(load_dir: str, spec_path: str, out: str, overrides: dict | None = None,
                    iteration: int | None = None) -> dict:
    """A Megatron checkpoint (its save directory's latest, `iteration`, or one iter_N/ folder)
    into a new specc checkpoint OUT at step N. Weights only: its optimizer state, if any, is not
    converted (the summary says whether there was some)."""
    fresh_output(out)
    read = read_weights(load_dir, spec_path, overrides, iteration)
    step = read["iteration"] or 0
    identity = read["identity"]
    path = save_tensors(out, step, read["tensors"], spec_sha256=identity["sha256"], spec_name=identity["name"],
                        config={"megatron_import": {"from": os.path.abspath(read["path"]), "format": read["format"],
                                                    "iteration": read["iteration"], "spec": spec_path,
                                                    "overrides": dict(overrides or {})}})
    return {"path": path, "step": step, "format": read["format"], "optimizer": read["optimizer"],
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
                            allow_spec_change: bool = False) -> dict:
    """What an export writes, read from a specc checkpoint: {"tensors" (Megatron's names),
    "modules" (with an _extra_state), "step", "spec"}. Under torch.distributed every rank calls it
    (the checkpoint's DCP read is collective), and every rank gets the full tensors."""
    spec, identity, params = model_params(spec_path, overrides)
    bind(mapping_of(spec_path, spec)[0], params, spec.name, Loc(spec_path))  # a spec without one: said first
    path = resolve(ckpt, step)
    info = read_info(path)
    check_spec(path, info["spec"], identity, allow_spec_change)
    check_params(path, info["params"], {n: {"shape": list(m.full_shape)} for n, m in params.items()})
    tensors, modules = megatron_tensors(read_tensors(path, list(params)), spec_path, spec, params)
    return {"tensors": tensors, "modules": modules, "step": info["step"], "spec": identity["name"]}


def export_megatron(ckpt: str, spec_path: str, out: str, overrides: dict | None = None, step: int | None = None,
                    allow_spec_change: bool = False) -> dict:
    """A specc checkpoint (any layout saved it) as a new Megatron Core torch_dist save directory
    OUT: iter_N/ (N its step) and latest_checkpointed_iteration.txt; weights only."""
    fresh_output(out)
    got = megatron_export_tensors(ckpt, spec_path, overrides, step, allow_spec_change)
    tensors = got["tensors"]
    created = not os.path.lexists(out)
    try:
        written = write_dist(out, got["step"], tensors, got["modules"])
    except BaseException:
        if created:  # nothing half-written is left: the folder goes too
            shutil.rmtree(out, ignore_errors=True)
        raise
    return {"path": written, "step": got["step"], "tensors": len(tensors),
            "parameters": sum(t.numel() for t in tensors.values()), "spec": got["spec"]}
