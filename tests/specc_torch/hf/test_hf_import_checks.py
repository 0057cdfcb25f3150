"""What `specc hf import` refuses in the files it reads, each in one line naming the file and what
is wrong, with nothing written (issue 23):

- tensors: NaN or infinite values (counted), integer or bool dtypes, float8 (quantized) formats;
- the sharded index: shard paths outside the folder (`../`, absolute, links that escape it) are
  refused before anything opens them; a weight_map that is missing, not an object, with values
  that are not file names, an index that is not JSON;
- config.json: values of the wrong type where import's checks read them (`rope_parameters: "x"`
  once skipped the rotary check, `architectures: 5` broke the architecture check)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_helpers import SPECS, save_hf
from safetensors.torch import load_file, save_file

from specc_cli.main import main
from specc_torch.hf import HFError, import_hf

pytest.importorskip("transformers")

INDEX = "model.safetensors.index.json"
EMB, NORM = "model.embed_tokens.weight", "model.norm.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base") / "llama"
    save_hf("llama", str(directory))
    return directory


@pytest.fixture
def hf(base, tmp_path):
    """A fresh copy of a random tiny Llama (config.json + model.safetensors) for specs/llama-tiny.yaml."""
    directory = tmp_path / "hf"
    shutil.copytree(base, directory)
    return directory


def _weights(hf_dir) -> dict:
    return load_file(str(hf_dir / "model.safetensors"))


def _put(hf_dir, tensors: dict, name: str = "model.safetensors") -> None:
    save_file(tensors, str(hf_dir / name), metadata={"format": "pt"})


def _refused(hf_dir, tmp_path) -> str:
    """import's error: one line, and nothing written."""
    out = tmp_path / "ckpt"
    with pytest.raises(HFError) as e:
        import_hf(str(hf_dir), SPECS["llama"], str(out))
    assert not os.path.exists(out)
    assert "\n" not in str(e.value)
    return str(e.value)


def _cli(hf_dir, tmp_path, capfd):
    """(exit code, stderr) of `specc hf import` run as the command line runs it."""
    code = main(["hf", "import", str(hf_dir), "--spec", SPECS["llama"], "--out", str(tmp_path / "cli-ckpt")])
    out, err = capfd.readouterr()
    assert out == "" and not os.path.exists(tmp_path / "cli-ckpt")
    return code, err


# -- tensors -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_weights_are_refused_with_their_count(hf, tmp_path, dtype):
    weights = {k: v.to(dtype) for k, v in _weights(hf).items()}
    norm = weights[NORM].clone()
    norm[3] = float("nan")
    _put(hf, {**weights, NORM: norm})
    assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {NORM} has 1 of its 64 values not finite (1 NaN, "
                                      f"0 infinite); weights must be finite")
    emb = weights[EMB].clone()
    emb[5, :3] = float("inf")
    emb[7, 1] = float("-inf")
    emb[9, 2] = float("nan")
    _put(hf, {**weights, EMB: emb})
    assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {EMB} has 5 of its 16,384 values not finite "
                                      f"(1 NaN, 4 infinite); weights must be finite")


def test_integer_and_bool_weights_are_refused(hf, tmp_path, capfd):
    weights = _weights(hf)
    for dtype, name in ((torch.int64, EMB), (torch.int32, NORM), (torch.uint8, NORM), (torch.bool, NORM)):
        _put(hf, {**weights, name: weights[name].to(dtype)})
        shown = str(dtype).replace("torch.", "")
        assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {name} has dtype {shown}, but weights are "
                                          f"floating point (float32, bfloat16, float16 or float64)")
    assert _cli(hf, tmp_path, capfd) == (2, f"{hf}/model.safetensors: error: {NORM} has dtype bool, but weights are "
                                            f"floating point (float32, bfloat16, float16 or float64)\n")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_weights_are_refused(hf, tmp_path, dtype):
    weights = _weights(hf)
    _put(hf, {**weights, EMB: weights[EMB].to(dtype)})
    shown = str(dtype).replace("torch.", "")
    assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {EMB} is {shown}, a quantized format import does "
                                      f"not read (dequantize the checkpoint to bf16 or fp32 first, applying its "
                                      f"scales)")


# -- the sharded index ---------------------------------------------------------------------------------

def _shard(hf_dir, index, weights=None) -> dict:
    """`weights` (model.safetensors's) as two shards, model.safetensors removed; the index is `index`
    (None: the right one; a str: the index's whole text). Returns the right weight_map."""
    weights = weights or _weights(hf_dir)
    if os.path.exists(hf_dir / "model.safetensors"):
        os.remove(hf_dir / "model.safetensors")
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for fname, part in halves.items():
        _put(hf_dir, {n: weights[n] for n in part}, fname)
    right = {n: fname for fname, part in halves.items() for n in part}
    if index is None:
        index = {"metadata": {}, "weight_map": right}
    (hf_dir / INDEX).write_text(index if isinstance(index, str) else json.dumps(index))
    return right


def test_a_sharded_checkpoint_imports(hf, tmp_path):
    _shard(hf, None)
    assert import_hf(str(hf), SPECS["llama"], str(tmp_path / "ckpt"))["tensors"] == 21


def test_shards_outside_the_folder_are_refused_and_never_opened(hf, tmp_path, monkeypatch):
    """A weight_map naming ../other/..., an absolute path, or a shard that is a link out of the
    folder: one line, and safetensors never opens a file outside it (here a valid checkpoint that
    the old import read)."""
    import safetensors

    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(hf / "model.safetensors", other / "model.safetensors")
    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, *a, **kw: opened.append(str(path)) or
                        real_open(path, *a, **kw))
    weights = _weights(hf)
    index = str(hf / INDEX)

    _shard(hf, {"weight_map": {n: "../other/model.safetensors" for n in weights}}, weights)
    assert _refused(hf, tmp_path) == (f"{index}: weight_map names \"../other/model.safetensors\", which lies outside "
                                      f"the checkpoint folder (at {other}/model.safetensors; not read)")
    _shard(hf, {"weight_map": {n: str(other / "model.safetensors") for n in weights}}, weights)
    assert _refused(hf, tmp_path) == (f"{index}: weight_map names \"{other}/model.safetensors\", which is an absolute "
                                      f"path; the files of a checkpoint lie in its folder (not read)")
    _shard(hf, {"weight_map": {n: "linked.safetensors" for n in weights}}, weights)
    os.symlink(other / "model.safetensors", hf / "linked.safetensors")
    assert _refused(hf, tmp_path) == (f"{index}: weight_map names \"linked.safetensors\", which lies outside the "
                                      f"checkpoint folder (at {other}/model.safetensors; not read)")
    # the same holds for model.safetensors and config.json themselves
    os.remove(hf / INDEX)
    os.symlink(other / "model.safetensors", hf / "model.safetensors")
    assert _refused(hf, tmp_path) == (f"{hf}: model.safetensors lies outside the checkpoint folder (at "
                                      f"{other}/model.safetensors; not read)")
    assert opened == []


def test_a_hugging_face_cache_snapshot_is_read_through_its_links(hf, tmp_path):
    """The Hugging Face cache keeps a snapshot's files as links to ../../blobs/<hash>: those are
    inside the checkpoint (its repository), and import reads them; a link to a folder is fine too."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for fname in os.listdir(hf):
        shutil.copy(hf / fname, repo / "blobs" / f"sha-{fname}")
        os.symlink(f"../../blobs/sha-{fname}", snapshot / fname)
    assert import_hf(str(snapshot), SPECS["llama"], str(tmp_path / "a"))["tensors"] == 21
    os.symlink(snapshot, tmp_path / "link")
    assert import_hf(str(tmp_path / "link"), SPECS["llama"], str(tmp_path / "b"))["tensors"] == 21


@pytest.mark.parametrize("index, what", [
    ({"metadata": {"total_size": 1}}, "no weight_map (the object of tensor name -> shard file a sharded checkpoint has)"),
    ({"weight_map": ["model-00001-of-00002.safetensors"]},
     "weight_map is [\"model-00001-of-00002.safetensors\"], not an object of tensor name -> shard file"),
    ({"weight_map": {EMB: 1}}, f"weight_map gives \"{EMB}\" 1, not a file name"),
    ({"weight_map": {EMB: ["model-00001-of-00002.safetensors"]}},
     f"weight_map gives \"{EMB}\" [\"model-00001-of-00002.safetensors\"], not a file name"),
    ({"weight_map": {}}, "weight_map is empty (it names no tensor)"),
    ({"weight_map": {EMB: "a\u0000b"}}, "weight_map names \"a\\u0000b\", which is not a file name"),
    ([1, 2], "not a JSON object"),
    ("this is { not json", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[" * 100000 + "]" * 100000, "nested too deeply to read"),
])
def test_a_malformed_index_is_one_line(hf, tmp_path, capfd, index, what):
    _shard(hf, index if isinstance(index, str) else json.dumps(index))
    assert _refused(hf, tmp_path) == f"{hf}/{INDEX}: {what}"
    assert _cli(hf, tmp_path, capfd) == (2, f"{hf}/{INDEX}: error: {what}\n")


def test_an_index_that_is_not_utf8_or_not_a_file(hf, tmp_path):
    _shard(hf, None)
    (hf / INDEX).write_bytes(b"\xff\xfe{")
    assert _refused(hf, tmp_path) == f"{hf}/{INDEX}: not UTF-8 text (JSON expected)"
    os.remove(hf / INDEX)
    os.mkfifo(hf / INDEX)  # opening it would wait for a writer forever
    assert _refused(hf, tmp_path) == (f"{hf}: {INDEX} is not a regular file (a FIFO, a device or a socket)")


def test_a_tensor_in_two_shards_is_refused(hf, tmp_path):
    weights = _weights(hf)
    right = _shard(hf, None)
    second = {n: weights[n] for n, f in right.items() if f.startswith("model-00002")}
    _put(hf, {**second, EMB: torch.zeros_like(weights[EMB])}, "model-00002-of-00002.safetensors")
    assert _refused(hf, tmp_path) == (f"{hf}: tensor {EMB} is in both model-00001-of-00002.safetensors and "
                                      f"model-00002-of-00002.safetensors")


# -- config.json ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, kind", [
    ("rope_parameters", "x", "an object"),
    ("rope_scaling", 7, "an object"),
    ("architectures", 5, "a list of class names"),
    ("architectures", "XLlamaForCausalLMX", "a list of class names"),
    ("architectures", ["LlamaForCausalLM", 5], "a list of class names"),
    ("layer_types", "sliding_attention", "a list of layer type names"),
    ("query_pre_attn_scalar", "x", "a number above 0"),
    ("query_pre_attn_scalar", -4, "a number above 0"),
    ("rope_theta", [10000.0], "a number"),
    ("sliding_window", True, "a number"),
    ("tie_word_embeddings", "yes", "true or false"),
])
def test_config_values_of_the_wrong_type_are_refused(hf, tmp_path, capfd, key, value, kind):
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, key: value}))
    what = f"{key} is {json.dumps(value)}, but must be {kind} (or null)"
    assert _refused(hf, tmp_path) == f"{hf}/config.json: {what}"
    assert _cli(hf, tmp_path, capfd) == (2, f"{hf}/config.json: error: {what}\n")


def test_a_config_that_cannot_be_read(hf, tmp_path):
    (hf / "config.json").write_text("[" * 100000 + "]" * 100000)
    assert _refused(hf, tmp_path) == f"{hf}/config.json: nested too deeply to read"
    (hf / "config.json").write_bytes(b"\xff\xfe{")
    assert _refused(hf, tmp_path) == f"{hf}/config.json: not UTF-8 text (JSON expected)"
    os.remove(hf / "config.json")
    os.symlink("/dev/zero", hf / "config.json")
    assert _refused(hf, tmp_path) == f"{hf}: config.json lies outside the checkpoint folder (at /dev/zero; not read)"
