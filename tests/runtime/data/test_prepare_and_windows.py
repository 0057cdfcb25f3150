"""`specc data prepare`'s library side and the training samples: tokens equal the text's bytes,
documents are indexed, bad input is one clear error and leaves nothing behind; windows are
seeded, splits disjoint, and each DP rank reads only its own samples."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from runtime.data import DataError, IndexedTokens, build_datasets, expand_inputs, prepare, split_ranges
from runtime.data.tokenizer import JsonTokenizer


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def test_byte_tokens_are_the_utf8_bytes_with_a_document_index(tmp_path):
    a = _write(tmp_path / "in" / "a.txt", "héllo\n".encode())
    b = _write(tmp_path / "in" / "b.py", b"print(1)\n")
    jl = _write(tmp_path / "in" / "c.jsonl", b'{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    out = str(tmp_path / "out")
    meta = prepare(expand_inputs([str(tmp_path / "in" / "*")]), "byte", out)
    data = IndexedTokens(out)
    assert meta["dtype"] == "uint8" and data.vocab_size == 256
    assert bytes(data.tokens) == "héllo\n".encode() + b"print(1)\n" + b"one" + b"two"
    assert data.offsets.tolist() == [0, 7, 16, 19, 22]  # a, b, and two .jsonl records
    assert [s["path"] for s in meta["sources"]] == [a, b, jl]
    assert json.load(open(os.path.join(out, "dataset.json")))["num_documents"] == 4
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temporary left


def test_bad_input_is_one_clear_error_and_leaves_nothing(tmp_path):
    out = str(tmp_path / "out")

    def error(files, tokenizer="byte", **kw):
        with pytest.raises(DataError) as e:
            prepare(files, tokenizer, out, **kw)
        assert "\n" not in str(e.value)
        assert not os.path.exists(out) and os.listdir(tmp_path) == [n for n in os.listdir(tmp_path)
                                                                    if not n.startswith(".")]
        return str(e.value)

    with pytest.raises(DataError, match="matches no files"):
        expand_inputs([str(tmp_path / "nothing" / "*.txt")])
    bad = _write(tmp_path / "in" / "latin1.txt", "café".encode("latin-1"))
    assert error([bad]) == f"{bad}: not UTF-8 text (byte 0xe9 at offset 3)"
    gone = str(tmp_path / "in" / "dangling.txt")
    os.symlink(str(tmp_path / "missing"), gone)
    assert gone in expand_inputs([str(tmp_path / "in" / "*.txt")])  # listed, but cannot be read
    assert error([gone]).startswith(f"{gone}: cannot read (")
    jl = _write(tmp_path / "in" / "x.jsonl", b'{"text": "ok"}\n{"body": "no text"}\n')
    assert error([jl]) == f"{jl}:2: no string field 'text' (set it with --json-key)"
    empty = _write(tmp_path / "in" / "empty.txt", b"")
    assert "no text" in error([empty])

    class BigVocab:
        name, vocab_size = "big", 70_000

        def encode(self, text):
            return [1, 2]

        def describe(self):
            return {"type": "test"}

    ok = _write(tmp_path / "in" / "ok.txt", b"abc")
    assert error([ok], BigVocab(), token_dtype="uint16") == (
        "the tokenizer's vocabulary (70000 tokens) does not fit --token-dtype uint16 (at most 65536 ids)")
    assert error([ok], token_dtype="uint3") .startswith("--token-dtype must be")
    assert "no such file" in error([ok], str(tmp_path / "missing.json"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not a prepared dataset; refusing"):
        prepare([ok], "byte", str(tmp_path / "notes"))
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_a_tokenizer_json_is_read_or_the_missing_package_named(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2},
                                                            "unk_token": "[UNK]"},
                                "pre_tokenizer": {"type": "Whitespace"}, "added_tokens": [], "normalizer": None,
                                "post_processor": None, "decoder": None, "truncation": None, "padding": None}))
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="needs the 'tokenizers' package"):
            JsonTokenizer(str(path))
        return
    src = _write(tmp_path / "t.txt", b"a b c a")
    meta = prepare([src], str(path), str(tmp_path / "out"))
    assert meta["vocab_size"] == 3 and list(IndexedTokens(str(tmp_path / "out")).tokens) == [1, 2, 0, 1]


@pytest.fixture(scope="module")
def numbers(tmp_path_factory):
    """A prepared token stream 0, 1, 2, ..., 19999: every window says where it came from."""
    out = tmp_path_factory.mktemp("numbers") / "prepared"
    out.mkdir()
    np.arange(20_000, dtype=np.uint16).tofile(out / "tokens.bin")
    np.save(out / "documents.npy", np.array([0, 5_000, 20_000], dtype=np.int64))
    (out / "dataset.json").write_text(json.dumps({"format": "specc-tokens", "version": 1, "vocab_size": 20_000,
                                                  "dtype": "uint16", "num_tokens": 20_000, "num_documents": 2,
                                                  "tokenizer": {"type": "test"}, "sources": []}))
    return str(out)


def test_windows_are_seeded_and_splits_disjoint(numbers):
    sets = build_datasets(numbers, seq_length=16, seed=7, weights=(0.9, 0.1, 0.0))
    train, valid = sets["train"], sets["valid"]
    assert (train.lo, train.hi, valid.lo, valid.hi) == (0, 18_000, 18_000, 20_000)
    assert len(train) == (18_000 - 1) // 16 and len(sets["test"]) == 0
    starts = {int(train.sample(j)[0]) for j in range(len(train))}  # one epoch: every window once
    assert len(starts) == len(train)
    w = train.sample(3)
    assert len(w) == 17 and np.array_equal(np.diff(w), np.ones(16)) and w.dtype == np.int64
    again = build_datasets(numbers, 16, 7, (0.9, 0.1, 0.0))["train"]
    other = build_datasets(numbers, 16, 8, (0.9, 0.1, 0.0))["train"]
    assert all(np.array_equal(train.sample(j), again.sample(j)) for j in range(50))
    assert not all(np.array_equal(train.sample(j), other.sample(j)) for j in range(50))
    assert all(18_000 <= valid.sample(j)[0] and valid.sample(j)[-1] < 20_000 for j in range(len(valid)))
    # a second epoch is a new order of the same windows
    n = len(train)
    assert sorted(int(train.sample(n + j)[0]) for j in range(n)) == sorted(starts)
    assert split_ranges(100, (0.5, 0.3, 0.2)) == {"train": (0, 50), "valid": (50, 80), "test": (80, 100)}


def test_each_dp_rank_reads_only_its_own_samples(numbers):
    ds = build_datasets(numbers, 8, 1, (1.0, 0.0, 0.0))["train"]
    read = []
    original = ds.sample
    ds.sample = lambda j: (read.append(j), original(j))[1]
    mbs, dp, consumed = 3, 2, 60
    per_rank = {}
    for r in range(dp):
        read.clear()
        rows = [ds.micro_batch(consumed, m, mbs, r, dp) for m in range(2)]
        per_rank[r] = list(read)
        for tokens, labels in rows:
            assert tokens.shape == labels.shape == (mbs, 8)
            assert np.array_equal(tokens[:, 1:], labels[:, :-1])
    assert not set(per_rank[0]) & set(per_rank[1])
    read.clear()
    for m in range(4):  # DP=1 with twice the micro-batches reads the same global batch
        ds.micro_batch(consumed, m, mbs, 0, 1)
    assert sorted(read) == sorted(per_rank[0] + per_rank[1]) == list(range(60, 72))
