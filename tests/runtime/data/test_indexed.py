"""Megatron's indexed dataset (.bin/.idx): files built here straight from the published layout
(struct and numpy, not specc's writer) read back as exactly the documents written; specc's
writer and `specc data prepare` produce those bytes exactly; every broken file is one line."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from runtime.data import DataError, IndexedDataset, IndexedDatasetBuilder, open_dataset, prepare, read_sidecar

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}


def published(prefix: str, documents: list, dtype) -> tuple[bytes, bytes]:
    """PREFIX.bin and PREFIX.idx for `documents` (each a list of sequences, each a list of ids),
    as megatron/core/datasets/indexed_dataset.py lays them out."""
    sequences = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    data = b"".join(s.tobytes() for s in sequences)
    sizes = [len(s) for s in sequences]
    pointers = [sum(sizes[:i]) * np.dtype(dtype).itemsize for i in range(len(sizes))]
    doc_index = [0]
    for doc in documents:
        doc_index.append(doc_index[-1] + len(doc))
    index = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype])
             + struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(doc_index))
             + struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(sizes)}q", *pointers)
             + struct.pack(f"<{len(doc_index)}q", *doc_index))
    with open(prefix + ".bin", "wb") as f:
        f.write(data)
    with open(prefix + ".idx", "wb") as f:
        f.write(index)
    return data, index


DOCS = [[[5, 6, 7]], [[1], [2, 3], []], [[65535, 0, 9, 9]], [[]], [[4] * 5]]  # sentence-level doc, empty ones


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_a_published_pair_reads_as_exactly_its_documents_and_specc_writes_the_same_bytes(tmp_path, dtype):
    docs = [[[t % 256 for t in s] for s in d] for d in DOCS] if dtype == np.uint8 else DOCS
    data, index = published(str(tmp_path / "ref"), docs, dtype)
    ds = IndexedDataset(str(tmp_path / "ref"))
    assert ds.dtype == np.dtype(dtype) and len(ds) == 7 and ds.num_documents == 5
    assert [ds.document(d).tolist() for d in range(5)] == [sum(d, []) for d in docs]
    assert [ds[i].tolist() for i in range(len(ds))] == [s for d in docs for s in d]
    assert ds.document_lengths.tolist() == [3, 3, 4, 0, 5] and ds.num_tokens == 15
    assert ds.token_range(2, 1, 3).tolist() == docs[2][0][1:3]
    assert ds.id_range(chunk=4) == (min(sum(sum(docs, []), [])), max(sum(sum(docs, []), [])))

    builder = IndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype)
    for doc in docs[:1]:
        builder.add_document(np.concatenate([np.asarray(s) for s in doc]), [len(s) for s in doc])
    for doc in docs[1:]:
        for s in doc:
            builder.add_item(np.asarray(s, dtype=np.int64))
        builder.end_document()
    builder.finalize(str(tmp_path / "ours.idx"))
    assert (tmp_path / "ours.bin").read_bytes() == data and (tmp_path / "ours.idx").read_bytes() == index


def test_specc_data_prepare_writes_what_megatron_preprocess_writes(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_text("héllo\n")
    b.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    meta = prepare([str(a), str(b)], "byte", str(tmp_path / "out" / "c_text_document"))
    # the byte tokenizer has no EOD; Megatron's optimal dtype for 256 ids is uint16
    _, index = published(str(tmp_path / "ref"), [[list("héllo\n".encode())], [list(b"one")], [list(b"two")]],
                         np.uint16)
    assert (tmp_path / "out" / "c_text_document.idx").read_bytes() == index
    assert (tmp_path / "out" / "c_text_document.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
    assert meta["num_documents"] == 3 and meta["dtype"] == "uint16" and meta["eod"] is None
    assert read_sidecar(str(tmp_path / "out" / "c_text_document"))["sources"][0]["path"] == str(a)
    assert sorted(os.listdir(tmp_path / "out")) == ["c_text_document.bin", "c_text_document.idx",
                                                    "c_text_document.specc.json"]  # no temporary left

    class WithEod:
        name, vocab_size, eod = "test", 70_000, 69_999

        def encode(self, text):
            return [len(text), 7]

        def describe(self):
            return {"type": "test"}

    prepare([str(a), str(b)], WithEod(), str(tmp_path / "eod"))
    _, index = published(str(tmp_path / "ref2"), [[[6, 7, 69_999]], [[3, 7, 69_999]], [[3, 7, 69_999]]], np.int32)
    assert (tmp_path / "eod.idx").read_bytes() == index and (tmp_path / "eod.bin").read_bytes() == \
        (tmp_path / "ref2.bin").read_bytes()
    assert open_dataset(str(tmp_path / "eod.bin")).prefix == str(tmp_path / "eod")  # PREFIX.bin names PREFIX


def _error(prefix) -> str:
    with pytest.raises(DataError) as e:
        IndexedDataset(str(prefix))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_broken_files_are_one_line_errors(tmp_path):
    p = str(tmp_path / "d")
    assert _error(p).startswith(f"{p}: no d.bin and d.idx (a dataset is a path prefix naming PREFIX.bin and "
                                "PREFIX.idx")
    data, index = published(p, [[[1, 2, 3]], [[4, 5]]], np.uint16)

    def write(idx=index, bin_=data):
        (tmp_path / "d.idx").write_bytes(idx)
        (tmp_path / "d.bin").write_bytes(bin_)

    write(b"NOTANIDX" + index[8:])
    assert _error(p) == f"{p}.idx: not a Megatron indexed dataset index (its first bytes are not b'MMIDIDX\\x00\\x00')"
    write(index[:9] + struct.pack("<Q", 2) + index[17:])
    assert _error(p) == f"{p}.idx: index version 2, only version 1 is known"
    write(index[:17] + b"\x09" + index[18:])
    assert _error(p).startswith(f"{p}.idx: unknown dtype code 9 (known: 1 uint8, 2 int8")
    write(index[:17] + b"\x07" + index[18:])
    assert _error(p) == f"{p}.idx: holds float32 values, not token ids"
    write(index[:20])
    assert _error(p) == f"{p}.idx: truncated (20 bytes, its header alone is 34)"
    write(index[:-8])
    assert _error(p) == (f"{p}.idx: {len(index) - 8} bytes, but 2 sequences and 3 document index entries need "
                         f"{len(index)} (truncated or not written whole)")
    write(bin_=data[:-2])
    assert _error(p) == (f"{p}.bin: 8 bytes, but its index says 5 uint16 tokens (10 bytes): truncated or not this "
                         "index's data")
    write(index[:-8] + struct.pack("<q", 1))
    assert _error(p).startswith(f"{p}.idx: a broken document index")
    pointers_at = 34 + 2 * 4
    write(index[:pointers_at + 8] + struct.pack("<q", 4) + index[pointers_at + 16:])
    assert _error(p) == f"{p}.idx: sequence pointers that are not the sizes laid end to end (a damaged index)"
    os.unlink(p + ".bin")
    assert _error(p).startswith(f"{p}: no d.bin (")
    old = tmp_path / "old"
    old.mkdir()
    (old / "dataset.json").write_text("{}")
    assert "a dataset in the format of an older specc" in _error(old)
