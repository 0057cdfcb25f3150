"""Reading a Hugging Face directory, the one way import sees HF_DIR: which files (_member), their
JSON (_read_json, read_hf_config, read_index) and their tensors (SafetensorsDir.get, _checked_tensor),
each checked before it is used; and the new folder an import or export writes (fresh_output)."""

from __future__ import annotations

import json
import os

import torch

from runtime.files import not_a_file

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFError(Exception):
    """A Hugging Face directory that does not fit the spec; one line naming what does not match."""


def safetensors_module():
    try:
        import safetensors.torch
    except ImportError:
        raise HFError("safetensors: not installed (pip install safetensors; specc hf reads and writes "
                      "safetensors files)") from None
    return safetensors


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


class SafetensorsDir:
    """The tensors of HF_DIR: model.safetensors, or the shards its index names (read_index); each
    tensor checked as it is read (`get`)."""

    def __init__(self, directory: str):
        safe_open = safetensors_module().safe_open
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


def fresh_output(out: str) -> None:
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
