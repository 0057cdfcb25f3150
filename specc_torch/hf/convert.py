"""Hugging Face <-> specc checkpoints through safetensors, driven by the spec's `hf:` mapping.

import: HF_DIR (config.json + model.safetensors, or a sharded index) -> a specc checkpoint of
    full tensors (step 0), loadable by runtime.checkpoint.load_checkpoint at any TP/DP layout.
export: a specc checkpoint (any layout it was saved at) -> HF_DIR that transformers'
    from_pretrained reads.

Reading HF_DIR is files.py's, the checks of its config.json against the spec checks.py's, and
each mapping entry's layout transform (transpose, fused segments, per-group rows, interleaved
rotary rows) layouts.py's; this file walks the parameters and writes the result.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil

import torch

from runtime.checkpoint import CheckpointError, read_info, read_tensors, resolve, save_tensors
from runtime.checkpoint.core import check_params, check_spec
from runtime.parallel_state import ProcessGroups
from specc.settings import Settings

from .. import api
from .checks import check_config, check_layer_kinds, check_modeled, layer_kinds
from .files import CONFIG, WEIGHTS, HFError, SafetensorsDir, fresh_output, read_hf_config, safetensors_module
from .layouts import check_permute, expert_count, segments, to_hf, to_specc, with_rotary
from .mapping import bind, expert_names, ignored, mapping_of

# -- the compiled model's parameters, without memory --------------------------------------------------

def model_params(spec_path: str, overrides: dict | None = None, with_graph: bool = False):
    """(spec, {"name", "sha256"}, {parameter name: ParamInit}) of the spec compiled at TP=1,
    built on the meta device (no memory, no initialization); and its op graph `with_graph`."""
    source, spec, graph = api.compile_source(spec_path, Settings(dtype="fp32"), overrides or {})
    module = api.load_module_from_source(source, spec.name)
    with torch.device("meta"):
        model = getattr(module, spec.root)(ProcessGroups.single(), None)
    params = {name: p._specc_init for name, p in model.named_parameters()}
    out = spec, {"name": module.SPEC_NAME, "sha256": module.SPEC_SHA256}, params
    return (*out, graph) if with_graph else out

# -- import -------------------------------------------------------------------------------------------

def import_hf(hf_dir: str, spec_path: str, out: str, overrides: dict | None = None) -> dict:
    """Import HF_DIR into a new specc checkpoint directory OUT (step 0). Returns a summary."""
    fresh_output(out)
    spec, identity, params, graph = model_params(spec_path, overrides, with_graph=True)
    mapping = with_rotary(mapping_of(spec), graph, spec.name)
    bound = bind(mapping, params, spec.name)
    config = read_hf_config(hf_dir)
    check_config(mapping, config, hf_dir, spec.name)
    # the ops read what transformers would: the architecture's defaults where config.json is silent
    defaults = {k: v for k, v in mapping.import_defaults.items() if config.get(k) is None}
    check_modeled(graph, {**config, **defaults}, hf_dir, spec.name)
    check_layer_kinds(mapping, graph, config, hf_dir, spec.name)
    source = SafetensorsDir(hf_dir)

    tensors, used = {}, set()
    for name, meta in params.items():
        entry, hf_names = bound[name]
        per_expert = []
        for names in expert_names(entry, hf_names, expert_count(name, meta, entry)):
            pieces = []
            for k, hf_name in enumerate(names):
                if hf_name not in source.where:
                    raise HFError(f"{hf_dir}: no tensor {hf_name} (for {name})")
                used.add(hf_name)
                tensor = source.get(hf_name)
                if entry.permute is not None:
                    check_permute(tensor.transpose(-2, -1) if entry.transpose else tensor, entry, hf_name, hf_dir)
                pieces.append(to_specc(tensor, mapping, entry.transpose, entry.rotary[k], entry.permute))
            if entry.fused:
                dim, sizes = segments(name, meta, entry, len(pieces))
                dim -= int(entry.experts)  # one expert's tensor: the expert dim 0 is not there
                for piece, size, hf_name in zip(pieces, sizes, names):
                    if piece.dim() <= dim or piece.shape[dim] != size:
                        raise HFError(f"{hf_dir}: {hf_name} has shape {list(piece.shape)}, but segment of {name} "
                                      f"has {size} along dim {dim}")
                per_expert.append(torch.cat(pieces, dim=dim))
            else:
                per_expert.append(pieces[0])
        full = torch.stack(per_expert) if entry.experts else per_expert[0]
        if tuple(full.shape) != tuple(meta.full_shape):
            shown = " + ".join(hf_names)
            raise HFError(f"{hf_dir}: {shown} gives {name} the shape {list(full.shape)}, but spec {spec.name} "
                          f"has {list(meta.full_shape)}")
        tensors[name] = full.contiguous()
    extra = sorted(n for n in source.where if n not in used and not ignored(mapping, n))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise HFError(f"{hf_dir}: tensor {extra[0]}{more} is not in spec {spec.name}'s hf mapping "
                      f"(map it, or list it under hf.ignore)")

    path = save_tensors(out, 0, tensors, spec_sha256=identity["sha256"], spec_name=identity["name"],
                        config={"hf_import": {"from": os.path.abspath(hf_dir), "architecture": mapping.architecture,
                                              "spec": spec_path, "overrides": dict(overrides or {})}})
    return {"path": path, "tensors": len(used), "parameters": sum(t.numel() for t in tensors.values()),
            "spec": identity["name"], "architecture": mapping.architecture}


# -- export -------------------------------------------------------------------------------------------

def export_hf(ckpt: str, spec_path: str, out: str, overrides: dict | None = None, step: int | None = None,
              allow_spec_change: bool = False) -> dict:
    """Export a specc checkpoint (a save directory's latest step, `step`, or one checkpoint) to a
    new Hugging Face directory OUT. Returns a summary."""
    save_file = safetensors_module().torch.save_file
    fresh_output(out)
    spec, identity, params, graph = model_params(spec_path, overrides, with_graph=True)
    mapping = with_rotary(mapping_of(spec), graph, spec.name)
    bound = bind(mapping, params, spec.name)
    path = resolve(ckpt, step)
    info = read_info(path)
    check_spec(path, info["spec"], identity, allow_spec_change)
    check_params(path, info["params"], {n: {"shape": list(m.full_shape)} for n, m in params.items()})
    full = read_tensors(path, list(params))

    tensors = {}
    for name, meta in params.items():
        entry, hf_names = bound[name]
        count = expert_count(name, meta, entry)
        for j, names in enumerate(expert_names(entry, hf_names, count)):
            tensor = full[name][j] if entry.experts else full[name]
            if entry.fused:
                dim, sizes = segments(name, meta, entry, len(names))
                pieces = torch.split(tensor, sizes, dim=dim - int(entry.experts))
            else:
                pieces = [tensor]
            for k, (piece, hf_name) in enumerate(zip(pieces, names)):
                tensors[hf_name] = to_hf(piece, mapping, entry.transpose, entry.rotary[k], entry.permute)
    dtypes = {t.dtype for t in tensors.values()}
    config = {"architectures": [mapping.architecture] if mapping.architecture else None, **mapping.config,
              **mapping.export_config}
    if mapping.layer_types is not None:
        config[mapping.layer_types[0]] = layer_kinds(mapping, graph, spec.name)
    if len(dtypes) == 1:
        config["dtype"] = str(dtypes.pop()).replace("torch.", "")
    config = {k: v for k, v in config.items() if v is not None}

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{secrets.token_hex(4)}")
    os.makedirs(tmp)
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": out, "tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values()),
            "step": info["step"], "spec": identity["name"], "architecture": mapping.architecture}


__all__ = ["HFError", "CheckpointError", "export_hf", "import_hf", "model_params", "read_hf_config", "check_config",
           "check_modeled"]
