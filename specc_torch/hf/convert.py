"""Hugging Face <-> specc checkpoints through safetensors, driven by the spec's `hf:` mapping.

import: HF_DIR (config.json + model.safetensors, or a sharded index) -> a specc checkpoint of
    full tensors (step 0), loadable by runtime.checkpoint.load_checkpoint at any TP/DP layout.
export: a specc checkpoint (any layout it was saved at) -> HF_DIR that transformers'
    from_pretrained reads.

Per mapping entry: GPT-2's Conv1D weights are [in, out] (`transpose: true`; the last two dims of
stacked experts, Llama 4's [E, in, out]); fused specc weights
([q | k | v], [gate | up]) are split into / joined from one HF tensor per segment, the segment
sizes coming from the compiled model; rotary q/k rows are permuted when the HF layout is
interleaved (specc's rotary op rotates halves, as HF Llama's weights already do).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil

import torch

from runtime.checkpoint import CheckpointError, read_info, read_tensors, resolve, save_tensors
from runtime.checkpoint.core import check_params, check_spec
from runtime.files import not_a_file
from runtime.parallel_state import ProcessGroups
from specc.errors import SpecError
from specc.settings import Settings

from .. import api
from .mapping import Mapping, bind, expert_names, ignored, mapping_of

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFError(Exception):
    """A Hugging Face directory that does not fit the spec; one line naming what does not match."""


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise HFError("safetensors: not installed (pip install safetensors; specc hf reads and writes "
                      "safetensors files)") from None
    return safetensors


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


# -- layout transforms ---------------------------------------------------------------------------------

def _interleaved_to_half(t: torch.Tensor, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """The first rotary_dim rows of each head (all, by default) from (x0, y0, x1, y1, ...) to
    (x0, x1, ..., y0, y1, ...); the rows that do not rotate stay where they are."""
    r = rotary_dim or head_dim
    heads = t.reshape(t.shape[0] // head_dim, head_dim, *t.shape[1:])
    turned = heads[:, :r].reshape(heads.shape[0], r // 2, 2, *t.shape[1:]).transpose(1, 2)
    return torch.cat([turned.reshape(heads.shape[0], r, *t.shape[1:]), heads[:, r:]], dim=1).reshape(t.shape)


def _half_to_interleaved(t: torch.Tensor, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    r = rotary_dim or head_dim
    heads = t.reshape(t.shape[0] // head_dim, head_dim, *t.shape[1:])
    turned = heads[:, :r].reshape(heads.shape[0], 2, r // 2, *t.shape[1:]).transpose(1, 2)
    return torch.cat([turned.reshape(heads.shape[0], r, *t.shape[1:]), heads[:, r:]], dim=1).reshape(t.shape)


def with_rotary(mapping: Mapping, graph, spec_name: str) -> Mapping:
    """The mapping with the rotary features its interleaved permutation covers, read from the
    spec's rotary ops: their head_dim must be the mapping's, and their rotary_dim is what turns
    (a partial rotary op under a whole-head permutation imported GPT-J off by 0.53)."""
    if mapping.rotary_layout != "interleaved":
        return mapping
    from specc.ops import OPS

    rotary = OPS["rotary"]
    dims = sorted({(op.attrs["head_dim"], rotary.rotary_dim(op.attrs)) for op in graph.iter_ops() if op.kind == "rotary"})
    if not dims:
        raise HFError(f"spec {spec_name}: hf.rotary says layout interleaved, but the spec has no rotary op "
                      "(drop hf.rotary)")
    if len(dims) > 1:
        raise HFError(f"spec {spec_name}: its rotary ops rotate different features ({dims}), which one hf.rotary "
                      "permutation cannot cover")
    head_dim, rotary_dim = dims[0]
    if mapping.rotary_head_dim != head_dim:
        raise HFError(f"spec {spec_name}: hf.rotary.head_dim is {mapping.rotary_head_dim}, but its rotary ops' "
                      f"head_dim is {head_dim}")
    return dataclasses.replace(mapping, rotary_dim=rotary_dim)


def _grouped_to_sections(t: torch.Tensor, groups: int, sections: tuple) -> torch.Tensor:
    """Rows from `groups` groups of [s0 | s1 | ...] (GPT-NeoX's per-head [q_h | k_h | v_h],
    Megatron's per-query-group layout) to [all s0 | all s1 | ...], group order kept in each."""
    per_group = t.reshape(groups, sum(sections), *t.shape[1:])
    return torch.cat([p.reshape(groups * n, *t.shape[1:]) for p, n in zip(per_group.split(list(sections), dim=1),
                                                                          sections)], dim=0)


def _sections_to_grouped(t: torch.Tensor, groups: int, sections: tuple) -> torch.Tensor:
    pieces = [p.reshape(groups, n, *t.shape[1:]) for p, n in zip(t.split([groups * n for n in sections], dim=0),
                                                                 sections)]
    return torch.cat(pieces, dim=1).reshape(t.shape)


def _check_permute(t: torch.Tensor, entry, hf_name: str, where: str) -> None:
    groups, sections = entry.permute
    if t.dim() == 0 or t.shape[0] != groups * sum(sections):
        raise HFError(f"{where}: {hf_name} has {t.shape[0] if t.dim() else 0} rows, but its permute needs "
                      f"{groups} groups of {sum(sections)} = {groups * sum(sections)}")


def _to_specc(t: torch.Tensor, mapping: Mapping, transpose: bool, rotary: bool, permute=None) -> torch.Tensor:
    if transpose:  # the last two dims: [in, out] matrices, or stacked experts [E, in, out] (Llama 4's)
        t = t.transpose(-2, -1)
    if permute is not None:
        t = _grouped_to_sections(t, *permute)
    if rotary and mapping.rotary_layout == "interleaved":
        t = _interleaved_to_half(t, mapping.rotary_head_dim, mapping.rotary_dim)
    return t


def _to_hf(t: torch.Tensor, mapping: Mapping, transpose: bool, rotary: bool, permute=None) -> torch.Tensor:
    if rotary and mapping.rotary_layout == "interleaved":
        t = _half_to_interleaved(t, mapping.rotary_head_dim, mapping.rotary_dim)
    if permute is not None:
        t = _sections_to_grouped(t, *permute)
    if transpose:
        t = t.transpose(-2, -1)
    return t.contiguous().clone()  # its own storage: safetensors refuses tensors that share memory


def _expert_count(name: str, meta, entry) -> int:
    """How many per-expert tensors an entry with {e} stacks: the parameter's expert dim (0)."""
    if not entry.experts:
        return 1
    if meta.expert_dim != 0:
        raise SpecError(entry.loc, f"'{name}' is not a stacked expert weight, but its hf names have {{e}}",
                        "{e} stacks per-expert tensors into a parameter whose dim 0 holds the experts")
    return meta.full_shape[0]


def _segments(name: str, meta, entry, count: int) -> tuple:
    if meta.shard_dim is None or len(meta.segments) != count:
        have = f"segments {list(meta.segments)}" if meta.shard_dim is not None else "no segments"
        raise SpecError(entry.loc, f"'{name}' has {have}, but the hf mapping names {count} tensors for it",
                        "give one hf name per segment, in segment order")
    return meta.shard_dim, list(meta.segments)


# -- reading a Hugging Face directory -------------------------------------------------------------------
#
# Everything import reads of HF_DIR passes through here: which files (_member), their JSON
# (_read_json, read_hf_config, read_index) and their tensors (_SafetensorsDir.get, _checked_tensor).

MAX_JSON_BYTES = 64 << 20  # config.json and a sharded index hold kilobytes to a few megabytes
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _allowed_roots(directory: str) -> list:
    """Where HF_DIR's files may lie once links are resolved: the folder itself; for a snapshot of
    the Hugging Face cache (`<repo>/snapshots/<revision>/`, whose files are links to
    `../../blobs/<hash>`), that repository's blobs/ too."""
    real = os.path.realpath(directory)
    roots = [real]
    if os.path.basename(os.path.dirname(real)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(real)), "blobs"))
    return roots


def _member(directory: str, name: str, listed_in: str | None = None) -> str | None:
    """The resolved path of HF_DIR's file `name` (or None when nothing is there), checked before
    anything opens it: a relative name whose path, links resolved, lies inside the folder (see
    _allowed_roots), and a regular file (not a FIFO, a device, a folder). `listed_in`: the file
    that named it (the index), which the error then points at."""
    where = os.path.join(directory, listed_in) if listed_in else directory
    shown = f"weight_map names {_short(name)}, which" if listed_in else name
    if not name or "\0" in name:
        raise HFError(f"{where}: weight_map names {_short(name)}, which is not a file name")
    if os.path.isabs(name):
        raise HFError(f"{where}: {shown} is an absolute path; the files of a checkpoint lie in its folder "
                      f"(not read)")
    path = os.path.join(directory, name)
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in _allowed_roots(directory)):
        raise HFError(f"{where}: {shown} lies outside the checkpoint folder (at {real}; not read)")
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(real):
        kind = "a folder" if os.path.isdir(real) else "missing (a broken link)" if not os.path.exists(real) \
            else "not a regular file (a FIFO, a device or a socket)"
        raise HFError(f"{where}: {shown} is {kind}")
    return real


def _short(value, limit: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= limit else text[:limit] + "..."


def _read_json(path: str, shown: str):
    """A JSON file of HF_DIR (a regular file, checked by _member), whatever it holds: any way it
    cannot be read is one line."""
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise HFError(f"{shown}: {size:,} bytes, more than a Hugging Face JSON file holds (at most "
                      f"{MAX_JSON_BYTES >> 20} MiB are read)")
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError:
        raise HFError(f"{shown}: not UTF-8 text (JSON expected)") from None
    except RecursionError:
        raise HFError(f"{shown}: nested too deeply to read") from None
    except ValueError as e:
        raise HFError(f"{shown}: not valid JSON ({e})") from None
    except OSError as e:
        raise HFError(f"{shown}: cannot be read ({e.strerror or e})") from None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_of_str(value) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


# The config.json keys import's checks read (check_config, the ops' HFKnobs), and the JSON type
# each must have where it is present and not null: a value of another type would be skipped by a
# check (`rope_parameters: "x"` is no rope at all to it, `architectures: "Llama..."` a substring
# test) or break it.
CONFIG_TYPES = {
    "architectures": ("a list of class names", _list_of_str),
    "rope_parameters": ("an object", lambda v: isinstance(v, dict)),
    "rope_scaling": ("an object", lambda v: isinstance(v, dict)),
    "layer_types": ("a list of layer type names", _list_of_str),
    "query_pre_attn_scalar": ("a number above 0", lambda v: _is_number(v) and v > 0),
    **{key: ("a number", _is_number) for key in ("rope_theta", "rotary_emb_base", "partial_rotary_factor",
                                                  "rotary_pct", "sliding_window", "attn_logit_softcapping",
                                                  "final_logit_softcapping")},
    **{key: ("true or false", lambda v: isinstance(v, bool)) for key in ("tie_word_embeddings", "use_sliding_window",
                                                                        "use_bidirectional_attention")},
}


def read_hf_config(directory: str) -> dict:
    """HF_DIR's config.json, a JSON object whose keys that import's checks read have their types
    (CONFIG_TYPES)."""
    path = os.path.join(directory, CONFIG)
    real = _member(directory, CONFIG)
    if real is None:
        raise HFError(f"{directory}: no {CONFIG}")
    config = _read_json(real, path)
    if not isinstance(config, dict):
        raise HFError(f"{path}: not a JSON object")
    for key, (kind, ok) in CONFIG_TYPES.items():
        value = config.get(key)
        if value is not None and not ok(value):
            raise HFError(f"{path}: {key} is {_short(value)}, but must be {kind} (or null)")
    return config


def read_index(directory: str) -> dict:
    """{shard file name: its resolved path} of HF_DIR's sharded index, every shard checked by
    _member before any is opened: a `weight_map` object of tensor name -> a file name inside the
    folder."""
    path = os.path.join(directory, INDEX)
    real = _member(directory, INDEX)
    if real is None:
        raise HFError(f"{directory}: no {INDEX}")
    index = _read_json(real, path)
    if not isinstance(index, dict):
        raise HFError(f"{path}: not a JSON object")
    if "weight_map" not in index:
        raise HFError(f"{path}: no weight_map (the object of tensor name -> shard file a sharded checkpoint has)")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise HFError(f"{path}: weight_map is {_short(weight_map)}, not an object of tensor name -> shard file")
    if not weight_map:
        raise HFError(f"{path}: weight_map is empty (it names no tensor)")
    for tensor, fname in weight_map.items():
        if not isinstance(fname, str):
            raise HFError(f"{path}: weight_map gives {_short(tensor)} {_short(fname)}, not a file name")
    files = {}
    for fname in sorted(set(weight_map.values())):
        files[fname] = _member(directory, fname, listed_in=INDEX)
        if files[fname] is None:
            raise HFError(f"{directory}: {fname}, listed in {INDEX}, is missing")
    return files


def _checked_tensor(t: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """A weight as import takes it: floating point of 16 bits or more (WEIGHT_DTYPES), every value
    finite. An integer or bool tensor is not a weight; float8 and narrower formats are quantized
    checkpoints whose scales (weight_scale_inv, ...) a cast would not apply; a NaN or an infinity
    turns every logit that reads it into NaN, so the model would train from garbage."""
    if t.dtype not in WEIGHT_DTYPES:
        dtype = str(t.dtype).replace("torch.", "")
        if t.dtype.is_floating_point:
            raise HFError(f"{where}: {name} is {dtype}, a quantized format import does not read (dequantize the "
                          f"checkpoint to bf16 or fp32 first, applying its scales)")
        raise HFError(f"{where}: {name} has dtype {dtype}, but weights are floating point (float32, bfloat16, "
                      f"float16 or float64)")
    finite = int(torch.isfinite(t).sum())
    if finite != t.numel():
        nan = int(torch.isnan(t).sum())
        raise HFError(f"{where}: {name} has {t.numel() - finite:,} of its {t.numel():,} values not finite ({nan:,} NaN, "
                      f"{t.numel() - finite - nan:,} infinite); weights must be finite")
    return t


class _SafetensorsDir:
    """The tensors of HF_DIR: model.safetensors, or the shards its index names (read_index); each
    tensor checked as it is read (`get`)."""

    def __init__(self, directory: str):
        safe_open = _safetensors().safe_open
        self.directory = directory
        if os.path.lexists(os.path.join(directory, INDEX)):
            files = read_index(directory)
        else:
            single = _member(directory, WEIGHTS)
            if single is None:
                raise HFError(f"{directory}: no {WEIGHTS} or {INDEX} (only safetensors checkpoints are read)")
            files = {WEIGHTS: single}
        self._handles, self.where = {}, {}
        for fname, path in files.items():
            try:
                handle = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors reports truncation etc. in several types
                raise HFError(f"{os.path.join(directory, fname)}: not a readable safetensors file ({e})") from None
            self._handles[fname] = handle
            for key in handle.keys():
                if key in self.where:
                    raise HFError(f"{directory}: tensor {key} is in both {self.where[key]} and {fname}")
                self.where[key] = fname

    def get(self, name: str) -> torch.Tensor:
        fname = self.where[name]
        where = os.path.join(self.directory, fname)
        try:
            tensor = self._handles[fname].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - as above
            raise HFError(f"{where}: {name} cannot be read ({e})") from None
        return _checked_tensor(tensor, name, where)


def _same_value(want, have) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return float(want) == float(have)
    return want == have


def check_config(mapping: Mapping, config: dict, where: str, spec_name: str) -> None:
    """Every value the mapping's `config` and `import_config` declare must equal config.json's
    (keys that config.json leaves out or sets to null are not checked)."""
    if mapping.architecture is not None and config.get("architectures"):
        if mapping.architecture not in config["architectures"]:
            raise HFError(f"{where}: the model is {', '.join(map(str, config['architectures']))}, but spec "
                          f"{spec_name} maps {mapping.architecture}")

    def walk(want: dict, have: dict, prefix: str) -> None:
        for key, value in want.items():
            got = have.get(key) if isinstance(have, dict) else None
            if got is None:
                continue
            if isinstance(value, dict) and isinstance(got, dict):
                walk(value, got, f"{prefix}{key}.")
            elif not _same_value(value, got):
                raise HFError(f"{where}: config.json has {prefix}{key} = {json.dumps(got)}, but spec {spec_name} "
                              f"gives {json.dumps(value)}")

    walk(mapping.config, config, "")
    walk(mapping.import_config, config, "")


def _same_request(want, have) -> bool:
    if want is None or have is None:
        return want is None and have is None
    if isinstance(want, bool) or isinstance(have, bool):
        return bool(want) is bool(have) if isinstance(want, bool) and isinstance(have, bool) else False
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return abs(float(want) - float(have)) <= 1e-9 * max(abs(float(want)), abs(float(have)))
    return want == have


def _shown(value) -> str:
    return "none" if value is None else json.dumps(value)


def check_modeled(graph, config: dict, where: str, spec_name: str) -> None:
    """Refuse a checkpoint whose config.json asks for behaviour the spec's ops do not model: every
    op kind declares the Hugging Face keys it knows (HFKnob: sliding_window, rope scaling, the
    partial rotary factor, soft-capping, tied embeddings...), and each is compared with what the
    model's ops of that kind do, op by op, so nothing depends on a spec author listing the key."""
    from specc.ops import OPS

    for kind in OPS.values():
        knobs = kind.hf_knobs()
        if not knobs:
            continue
        ops = [op for op in graph.iter_ops() if op.kind == kind.name]
        for knob in knobs:
            want = knob.requested(config, len(ops))
            if want is None:
                continue
            if knob.any:
                (asked,) = want
                for have in [v for v in (knob.modeled(op.attrs) for op in ops) if v] or [knob.absent]:
                    if not _same_request(asked, have):
                        raise HFError(f"{where}: config.json asks for {knob.key} = {_shown(asked)}, but spec {spec_name}'s "
                                      f"{kind.name} ops model {_shown(have)}")
                continue
            for op, asked in zip(ops, want):
                have = knob.modeled(op.attrs)
                if not _same_request(asked, have):
                    raise HFError(f"{where}: config.json asks for {knob.key} = {_shown(asked)}, but spec {spec_name} "
                                  f"models {_shown(have)} at {op.id} ({kind.name})")


def layer_kinds(mapping: Mapping, graph, spec_name: str) -> list:
    """The kind config.json gives each layer of the repeated block (hf.layer_types), by the module
    the spec builds it from: [] when the mapping declares none."""
    if mapping.layer_types is None:
        return []
    key, names = mapping.layer_types
    blocks = [scope for scope in graph.repeats if "." not in scope]
    if len(blocks) != 1:
        raise HFError(f"spec {spec_name}: hf.layer_types names the kinds of one repeated block, but the model has "
                      f"{len(blocks)}")
    modules = [graph.scopes[f"{blocks[0]}.{i}"] for i in range(graph.repeats[blocks[0]])]
    missing = sorted(set(modules) - set(names))
    if missing:
        raise HFError(f"spec {spec_name}: hf.layer_types.names has no kind for module {missing[0]}")
    return [names[m] for m in modules]


def check_layer_kinds(mapping: Mapping, graph, config: dict, where: str, spec_name: str) -> None:
    """config.json's list of layer kinds (when it has one) must be the spec's, layer by layer."""
    kinds = layer_kinds(mapping, graph, spec_name)
    have = config.get(mapping.layer_types[0]) if kinds else None
    if have is None:
        return
    if have != kinds:
        at = next((i for i, (a, b) in enumerate(zip(have, kinds)) if a != b), min(len(have), len(kinds)))
        got = f"{have[at]!r}" if isinstance(have, list) and at < len(have) else "nothing"
        raise HFError(f"{where}: config.json's {mapping.layer_types[0]} has {len(have) if isinstance(have, list) else have} "
                      f"layers and {got} at layer {at}, but spec {spec_name} builds "
                      f"{kinds[at] if at < len(kinds) else 'nothing'} there ({len(kinds)} layers)")


# -- import -------------------------------------------------------------------------------------------

def _fresh_output(out: str) -> None:
    """OUT is nothing, or an empty folder (not a link to one): what is written replaces only that."""
    if not out:
        raise HFError("the output directory is empty (give a new directory to write)")
    if not os.path.lexists(out):
        return
    what = not_a_file(out) or "a file"
    if what != "a folder":
        raise HFError(f"{out}: is {what}, not a folder: only a new or empty folder is written, and it is left as it "
                      "is (choose a new directory)")
    if os.listdir(out):
        raise HFError(f"{out}: already exists and is not empty (choose a new directory)")


def import_hf(hf_dir: str, spec_path: str, out: str, overrides: dict | None = None) -> dict:
    """Import HF_DIR into a new specc checkpoint directory OUT (step 0). Returns a summary."""
    _fresh_output(out)
    spec, identity, params, graph = model_params(spec_path, overrides, with_graph=True)
    mapping = with_rotary(mapping_of(spec), graph, spec.name)
    bound = bind(mapping, params, spec.name)
    config = read_hf_config(hf_dir)
    check_config(mapping, config, hf_dir, spec.name)
    # the ops read what transformers would: the architecture's defaults where config.json is silent
    defaults = {k: v for k, v in mapping.import_defaults.items() if config.get(k) is None}
    check_modeled(graph, {**config, **defaults}, hf_dir, spec.name)
    check_layer_kinds(mapping, graph, config, hf_dir, spec.name)
    source = _SafetensorsDir(hf_dir)

    tensors, used = {}, set()
    for name, meta in params.items():
        entry, hf_names = bound[name]
        per_expert = []
        for names in expert_names(entry, hf_names, _expert_count(name, meta, entry)):
            pieces = []
            for k, hf_name in enumerate(names):
                if hf_name not in source.where:
                    raise HFError(f"{hf_dir}: no tensor {hf_name} (for {name})")
                used.add(hf_name)
                tensor = source.get(hf_name)
                if entry.permute is not None:
                    _check_permute(tensor.transpose(-2, -1) if entry.transpose else tensor, entry, hf_name, hf_dir)
                pieces.append(_to_specc(tensor, mapping, entry.transpose, entry.rotary[k], entry.permute))
            if entry.fused:
                dim, sizes = _segments(name, meta, entry, len(pieces))
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
    save_file = _safetensors().torch.save_file
    _fresh_output(out)
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
        count = _expert_count(name, meta, entry)
        for j, names in enumerate(expert_names(entry, hf_names, count)):
            tensor = full[name][j] if entry.experts else full[name]
            if entry.fused:
                dim, sizes = _segments(name, meta, entry, len(names))
                pieces = torch.split(tensor, sizes, dim=dim - int(entry.experts))
            else:
                pieces = [tensor]
            for k, (piece, hf_name) in enumerate(zip(pieces, names)):
                tensors[hf_name] = _to_hf(piece, mapping, entry.transpose, entry.rotary[k], entry.permute)
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
