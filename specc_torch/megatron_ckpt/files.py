"""Megatron Core's checkpoint files, without Megatron and without unpickling arbitrary objects.

    SAVE_DIR/latest_checkpointed_iteration.txt     "7" (or "release": the release/ folder)
    SAVE_DIR/iter_0000007/                          --ckpt-format torch_dist (the default)
        metadata.json                               {"sharded_backend": "torch_dist", ...}
        .metadata, __R_0.distcp                     torch.distributed.checkpoint: every tensor at
                                                    its global shape, whatever TP/PP saved it
        common.pt                                   older versions; newer keep it in the DCP entry
                                                    common_state/shard_0_1
    SAVE_DIR/iter_0000007/mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt    --ckpt-format torch (legacy)

A torch_dist checkpoint stores a decoder layer's weights stacked over the layers:
`decoder.layers.self_attention.linear_qkv.weight` is [num_layers, ...] (Megatron's default,
homogeneous layers); with non-homogeneous layers each has its own `decoder.layers.N....` key.
Both read here as per-layer names, `decoder.layers.N.X`, which is also what the legacy format and
Megatron's module names say. Everything pickled (DCP's .metadata, model_optim_rng.pt) goes
through `SafeUnpickler`: torch's tensor rebuilders and DCP's metadata classes are allowed, any
other global becomes an inert `Unpickled` record that runs no code.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import secrets
import shutil
import warnings

import torch
import torch._utils as torch_utils
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
COMMON_KEY = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER = re.compile(r"^(?P<pre>(?:.*\.)?layers)\.(?P<i>\d+)\.(?P<rest>.+)$")
# Megatron's local layer spec names its norms apart, and maps them (sharded_state_dict_keys_map)
# onto the fused names of its Transformer Engine spec so that both read the same checkpoints
NORM_KEYS = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
             ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
# The experts of its local spec's MoE layer (SequentialMLP) are modules mlp.experts.local_experts.E;
# its sharded_state_dict stacks them over the experts as mlp.experts.experts.X ([E, ...] in a layer,
# [layers, E, ...] in torch_dist), the names read and written here for both formats
LOCAL_EXPERT = re.compile(r"^(?P<pre>.*\.experts\.)local_experts\.(?P<e>\d+)\.(?P<rest>.+)$")
STACKED_EXPERTS = ".experts.experts."


class MegatronError(Exception):
    """A Megatron checkpoint that cannot be read or written as asked; one line."""


# -- reading pickles without running them ------------------------------------------------------------

class Unpickled:
    """What a global outside the allow-list unpickles to: its name and arguments, nothing run."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):  # a dict subclass's items
        pass

    def append(self, value):  # a list subclass's items
        pass

    def extend(self, values):
        pass


def _allowed(module: str, name: str):
    if module == "collections" and name == "OrderedDict":
        import collections
        return collections.OrderedDict
    if module == "argparse" and name == "Namespace":
        import argparse
        return argparse.Namespace
    if module == "_codecs" and name == "encode":  # bytes under pickle protocol 2
        import codecs
        return codecs.encode
    if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_tensor"):
        return getattr(torch_utils, name)
    if module == "torch":
        value = getattr(torch, name, None)
        if name == "Size" or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner") or (
            module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo"):
        import importlib
        value = getattr(importlib.import_module(module), name, None)
        if isinstance(value, type):
            return value
    return None


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        found = _allowed(module, name)
        if found is not None:
            return found
        return type(name, (Unpickled,), {"module": module})


class _SafePickle:  # a pickle module for torch.load(pickle_module=...): torch's storages, our globals
    Unpickler = SafeUnpickler
    load = staticmethod(lambda f, **kw: SafeUnpickler(f, **kw).load())
    __name__ = "specc_safe_pickle"


def safe_torch_load(path: str):
    """torch.load of a file written by torch.save, with SafeUnpickler's allow-list."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", pickle_module=_SafePickle, weights_only=False)


class _SafeReader(dcp.FileSystemReader):
    """DCP's reader, its .metadata unpickled with the allow-list (DCP's own uses pickle.load)."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = SafeUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# -- the save directory --------------------------------------------------------------------------

def iteration_dir(save_dir: str, iteration: int | None = None) -> tuple[str, int | None]:
    """(the checkpoint folder, its iteration) of a Megatron save directory: the tracker's, or
    `iteration`; a folder that is itself one iteration's is taken as it is."""
    if is_iteration_dir(save_dir):
        m = re.search(r"iter_(\d+)$", os.path.normpath(save_dir))
        return save_dir, int(m.group(1)) if m else None
    if iteration is None:
        tracker = os.path.join(save_dir, TRACKER)
        if not os.path.isfile(tracker):
            raise MegatronError(f"{save_dir}: not a Megatron checkpoint (no {TRACKER}, no iter_*/ with its files)")
        with open(tracker, encoding="utf-8", errors="replace") as f:
            text = f.read(64).strip()
        if text == "release":
            return os.path.join(save_dir, "release"), None
        if not text.isdigit():
            raise MegatronError(f"{tracker}: holds {text[:20]!r}, not an iteration number or 'release'")
        iteration = int(text)
    path = os.path.join(save_dir, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise MegatronError(f"{save_dir}: no iter_{iteration:07d}/ (iteration {iteration})")
    return path, iteration


def is_iteration_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json")) or bool(_legacy_files(path))


def is_megatron_dir(path: str) -> bool:
    """A Megatron save directory (its tracker file) or one iteration's folder."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, TRACKER)) or is_iteration_dir(path))


def checkpoint_format(path: str) -> str:
    """'torch_dist' or 'torch' (legacy) of one iteration's folder."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        try:
            with open(os.path.join(path, "metadata.json"), encoding="utf-8") as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            raise MegatronError(f"{path}/metadata.json: not readable as JSON") from None
        if backend != "torch_dist":
            raise MegatronError(f"{path}: a {backend!r} distributed checkpoint; only torch_dist (and the legacy "
                                f"torch format) are read")
        return "torch_dist"
    if _legacy_files(path):
        return "torch"
    raise MegatronError(f"{path}: neither a torch_dist checkpoint (metadata.json) nor legacy mp_rank_*/{LEGACY_FILE}")


# -- torch_dist ------------------------------------------------------------------------------------

def _per_layer(key: str, size0: int) -> list:
    """The per-layer names a stacked key stands for: decoder.layers.X -> decoder.layers.N.X."""
    pre, _, rest = key.partition("layers.")
    return [f"{pre}layers.{i}.{rest}" for i in range(size0)]


def _stacked(key: str) -> bool:
    return ".layers." in f".{key}" and not LAYER.match(key)


def dist_tensors(path: str) -> dict:
    """{per-layer name: (DCP key, layer index or None, shape, dtype)} of a torch_dist checkpoint's
    tensors, and the names of its byte objects (extra state, common state) under None."""
    try:
        metadata = _SafeReader(path).read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise MegatronError(f"{path}/.metadata: not readable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                            ) from None
    out, objects = {}, []
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, BytesStorageMetadata):
            objects.append(key)
        elif isinstance(meta, TensorStorageMetadata):
            shape, dtype = tuple(meta.size), meta.properties.dtype
            if _stacked(key) and len(shape) >= 1:
                for i, name in enumerate(_per_layer(key, shape[0])):
                    out[name] = (key, i, shape[1:], dtype)
            else:
                out[key] = (key, None, shape, dtype)
    out[None] = objects
    return out


def read_dist(path: str, wanted: dict) -> dict:
    """{name: tensor} for the per-layer names asked (wanted: dist_tensors' entries), each stacked
    key read once at its global shape."""
    keys = {}
    for key, _i, _shape, _dtype in wanted.values():
        keys.setdefault(key, None)
    meta = _SafeReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=_SafeReader(path), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise MegatronError(f"{path}: reading the checkpoint failed: {str(e).strip().splitlines()[-1][:200]}") from None
    return {name: (state[key][i] if i is not None else state[key]) for name, (key, i, _s, _d) in wanted.items()}


class _ObjectPlanner(DefaultLoadPlanner):
    """DCP's load planner, its byte objects unpickled with the allow-list (DCP's own torch.loads
    them with weights_only=False) and kept here (dcp.load does not hand non-tensors back)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.objects = {}

    def load_bytes(self, read_item, value) -> None:
        value.seek(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.objects[read_item.dest_index.fqn] = torch.load(value, map_location="cpu", pickle_module=_SafePickle,
                                                                weights_only=False)


def read_common(path: str) -> dict:
    """The common (not sharded) state of a torch_dist checkpoint: the training loop's args,
    iteration, the optimizer's param_groups and step, the content metadata; {} where there is
    none. Newer versions keep it in the DCP object common_state/shard_0_1, older in common.pt."""
    if os.path.isfile(os.path.join(path, "common.pt")):
        common = safe_torch_load(os.path.join(path, "common.pt"))
        return common if isinstance(common, dict) else {}
    try:
        if COMMON_KEY not in _SafeReader(path).read_metadata().state_dict_metadata:
            return {}
        planner = _ObjectPlanner()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load({COMMON_KEY: io.BytesIO()}, storage_reader=_SafeReader(path), planner=planner, no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise MegatronError(f"{path}: reading its common state failed: {str(e).strip().splitlines()[-1][:200]}"
                            ) from None
    common = planner.objects.get(COMMON_KEY)
    common = common[0] if isinstance(common, list) and len(common) == 1 else common
    return common if isinstance(common, dict) else {}


def write_dist(save_dir: str, iteration: int, tensors: dict, extra_state: list, common: dict | None = None) -> str:
    """A torch_dist checkpoint of full tensors by per-layer name in the new or empty SAVE_DIR:
    layer weights stacked as Megatron's homogeneous layers store them, `extra_state` (module
    names) an empty _extra_state object each, the common state Megatron's load reads, the
    tracker last. Written beside and renamed into place."""
    stacks, flat = {}, {}
    for name, t in tensors.items():
        m = LAYER.match(name)
        if m:
            stacks.setdefault(f"{m['pre']}.{m['rest']}", {})[int(m["i"])] = t
        else:
            flat[name] = t.contiguous()
    state = dict(flat)
    for key, layers in stacks.items():
        if sorted(layers) != list(range(len(layers))):
            raise MegatronError(f"{key}: layers {sorted(layers)} are not 0..{len(layers) - 1}")
        state[key] = torch.stack([layers[i] for i in range(len(layers))])
    count = len(next(iter(stacks.values()))) if stacks else 1
    for module in extra_state:  # one object per layer (and expert), Megatron's ShardedObject over those axes
        m = LAYER.match(module)
        if m and STACKED_EXPERTS in module:
            weight = tensors.get(f"{module}.weight")
            if weight is None:
                raise MegatronError(f"{module}: an expert module's _extra_state, but no {module}.weight is written")
            experts = weight.shape[0]
            for i in range(count):
                for e in range(experts):
                    state[f"{m['pre']}.{m['rest']}._extra_state/shard_{i}.{e}_{count}.{experts}"] = _pickled(None)
        elif m:
            for i in range(count):
                state[f"{m['pre']}.{m['rest']}._extra_state/shard_{i}_{count}"] = _pickled(None)
        else:
            state[f"{module}._extra_state/shard_0_1"] = _pickled(None)
    state[COMMON_KEY] = _pickled({"checkpoint_version": 3.0, "iteration": iteration, **(common or {})})

    save_dir = os.path.abspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    name = f"iter_{iteration:07d}"
    tmp = os.path.join(save_dir, f".{name}.tmp-{secrets.token_hex(4)}")
    os.makedirs(tmp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # not flattened: an object entry is one torch.save'd value (its list kept whole)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True,
                     planner=DefaultSavePlanner(flatten_state_dict=False))
        with open(os.path.join(tmp, "metadata.json"), "w", encoding="utf-8") as f:
            json.dump(METADATA_JSON, f)
        old = None
        if os.path.lexists(os.path.join(save_dir, name)):  # the same iteration saved again: the new one wins
            old = os.path.join(save_dir, f".{name}.old-{secrets.token_hex(4)}")
            os.rename(os.path.join(save_dir, name), old)
        os.rename(tmp, os.path.join(save_dir, name))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tracker_tmp = os.path.join(save_dir, f".{TRACKER}.tmp-{secrets.token_hex(4)}")
    with open(tracker_tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
    os.replace(tracker_tmp, os.path.join(save_dir, TRACKER))
    return os.path.join(save_dir, name)


def _pickled(obj) -> list:
    """A ShardedObject's value as Megatron's torch strategy writes it (DCP torch.saves it): [data]."""
    return [obj]


# -- legacy (--ckpt-format torch) -----------------------------------------------------------------

def _legacy_files(path: str) -> dict:
    """{(tp, pp, ep): file} of one iteration's legacy folder."""
    out = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for d in names:
        m = RANK_DIR.match(d)
        if m and os.path.isfile(os.path.join(path, d, LEGACY_FILE)):
            out[(int(m[1]), int(m[2] or 0), int(m[3] or 0))] = os.path.join(path, d, LEGACY_FILE)
    return out


def read_legacy(path: str) -> tuple[dict, bool]:
    """({(tp rank, pp rank): {per-layer name: tensor}}, has optimizer state) of a legacy
    checkpoint: each stage's local layer numbers made global, the local spec's norm names mapped
    onto the fused ones (NORM_KEYS), a layer's local experts stacked (LOCAL_EXPERT), _extra_state
    dropped."""
    files = _legacy_files(path)
    if any(ep for _tp, _pp, ep in files):
        raise MegatronError(f"{path}: expert-parallel legacy checkpoints (mp_rank_TT_PPP_EEE) are not read")
    loaded = {}
    if files:  # EP without PP names its folders mp_rank_TT_EEE, as PP does: the saved args tell them apart
        first = min(files)
        loaded[first] = safe_torch_load(files[first])
        args = loaded[first].get("args") if isinstance(loaded[first], dict) else None
        ep = getattr(args, "expert_model_parallel_size", None) if isinstance(args, argparse.Namespace) else None
        if isinstance(ep, int) and ep > 1:
            raise MegatronError(f"{path}: expert-parallel legacy checkpoints (saved with --expert-model-parallel-size "
                                f"{ep}: mp_rank_TT[_PPP]_EEE) are not read")
    tps = sorted({tp for tp, _pp, _ep in files})
    pps = sorted({pp for _tp, pp, _ep in files})
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if len(pps) > 1 else "") for t in tps for p in pps
               if (t, p, 0) not in files]
    if tps != list(range(len(tps))) or pps != list(range(len(pps))) or missing:
        raise MegatronError(f"{path}: the ranks' folders are incomplete" + (f" (no {missing[0]})" if missing else ""))
    shards, optimizer = {}, False
    for pp in pps:
        for tp in tps:
            state = loaded.pop((tp, pp, 0), None) or safe_torch_load(files[(tp, pp, 0)])
            if not isinstance(state, dict):
                raise MegatronError(f"{files[(tp, pp, 0)]}: not a Megatron checkpoint (no dict inside)")
            optimizer = optimizer or bool(state.get("optimizer"))
            if not isinstance(state.get("model"), dict):
                models = sorted(str(k) for k in state if str(k).startswith("model"))
                raise MegatronError(f"{files[(tp, pp, 0)]}: no 'model' state"
                                    + (f" ({', '.join(models)}: virtual pipeline stages are not read)" if models else ""))
            shards[(tp, pp)] = {k: v for k, v in state["model"].items()
                                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    # each stage numbers its layers from 0: the layers of the stages before it come first
    counts = {pp: len({int(m["i"]) for k in shards[(0, pp)] if (m := LAYER.match(k))}) for pp in pps}
    offset = {pp: sum(counts[q] for q in pps if q < pp) for pp in pps}
    out = {}
    for (tp, pp), model in shards.items():
        renamed = {}
        for k, v in model.items():
            m = LAYER.match(k)
            if m:
                rest = m["rest"]
                for local, fused in NORM_KEYS:
                    if rest.startswith(local):
                        rest = fused + rest[len(local):]
                k = f"{m['pre']}.{int(m['i']) + offset[pp]}.{rest}"
            renamed[k] = v
        out[(tp, pp)] = _stack_experts(renamed, files[(tp, pp, 0)])
    return out, optimizer


def _stack_experts(model: dict, where: str) -> dict:
    """X.experts.local_experts.E.R (E = 0..n-1) as one X.experts.experts.R of [n, ...], as
    SequentialMLP's sharded_state_dict stacks them."""
    out, groups = {}, {}
    for k, v in model.items():
        m = LOCAL_EXPERT.match(k)
        if m:
            groups.setdefault(f"{m['pre']}experts.{m['rest']}", {})[int(m["e"])] = v
        else:
            out[k] = v
    for k, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise MegatronError(f"{where}: the local experts of {k} are {sorted(experts)}, not 0..{len(experts) - 1}")
        shapes = {tuple(t.shape) for t in experts.values()}
        if len(shapes) > 1:
            raise MegatronError(f"{where}: the local experts of {k} differ in shape ({sorted(shapes)})")
        out[k] = torch.stack([experts[e] for e in range(len(experts))])
    return out
