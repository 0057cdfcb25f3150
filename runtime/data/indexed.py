"""Megatron's indexed dataset (megatron/core/datasets/indexed_dataset.py, the "mmap" format that
`tools/preprocess_data.py` writes), read and written byte for byte. A dataset is a path prefix:

    PREFIX.bin   every sequence's token ids, concatenated, raw little-endian (dtype below)
    PREFIX.idx   the index:
                 magic            9 bytes  b"MMIDIDX\\x00\\x00"
                 version          <Q       1
                 dtype code       <B       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                           6 float64, 7 float32, 8 uint16
                 sequence count   <Q       S
                 document count   <Q       D + 1 (entries of the document index)
                 sizes            int32[S]   tokens per sequence
                 pointers         int64[S]   byte offset of each sequence in PREFIX.bin
                 document index   int64[D+1] document d is sequences doc[d] .. doc[d+1] - 1
                 (modes           int8[S]    multimodal datasets only; not used here)

`specc data prepare` writes one sequence per document (Megatron's `_text_document` level); a
document of several sequences (sentence-level preprocessing) is read as their concatenation.
Everything is memory-mapped: opening a dataset checks the index against the data file and reads
no tokens; `token_range` reads only what it returns.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from .errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, the two counts: 34
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "int32": np.int32, "int64": np.int64}


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def optimal_dtype(vocab_size: int):
    """Megatron's DType.optimal_dtype: uint16 below 65500 ids, int32 otherwise (what
    preprocess_data writes, so that the same tokens give the same bytes)."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_capacity(dtype) -> int:
    """How many distinct token ids (0, 1, ...) a dtype holds."""
    return int(np.iinfo(dtype).max) + 1


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class IndexedDataset:
    """Megatron's IndexedDataset at `prefix`: `sequence_lengths`, `sequence_pointers`,
    `document_indices` as in Megatron, `dataset[i]` the tokens of sequence i, and the
    document view that training samples from (`document_lengths`, `token_range`)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        missing = [p for p in (bpath, ipath) if not os.path.isfile(p)]
        if missing and os.path.isfile(os.path.join(prefix, "dataset.json")):
            raise DataError(f"{prefix}: a dataset in the format of an older specc (a folder with dataset.json); "
                            "prepare it again with `specc data prepare --output-prefix PREFIX`, which writes "
                            "Megatron's PREFIX.bin and PREFIX.idx")
        if missing:
            what = " and ".join(os.path.basename(p) for p in missing)
            raise DataError(f"{prefix}: no {what} (a dataset is a path prefix naming PREFIX.bin and PREFIX.idx, as "
                            "Megatron's preprocess_data writes; make one with `specc data prepare`)")
        try:
            idx_size = os.path.getsize(ipath)
            with open(ipath, "rb") as f:
                header = f.read(HEADER_BYTES)
        except OSError as e:
            raise DataError(f"{ipath}: cannot read ({e.strerror or e})") from None
        if header[:len(INDEX_HEADER)] != INDEX_HEADER:
            raise DataError(f"{ipath}: not a Megatron indexed dataset index (its first bytes are not "
                            f"{INDEX_HEADER!r})")
        if len(header) < HEADER_BYTES:
            raise DataError(f"{ipath}: truncated ({idx_size} bytes, its header alone is {HEADER_BYTES})")
        version, code, seq_count, doc_count = struct.unpack("<QBQQ", header[len(INDEX_HEADER):])
        if version != INDEX_VERSION:
            raise DataError(f"{ipath}: index version {version}, only version {INDEX_VERSION} is known")
        if code not in DTYPE_CODES:
            raise DataError(f"{ipath}: unknown dtype code {code} (known: "
                            + ", ".join(f"{c} {np.dtype(t).name}" for c, t in DTYPE_CODES.items()) + ")")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind == "f":
            raise DataError(f"{ipath}: holds {self.dtype.name} values, not token ids")
        expected = HEADER_BYTES + seq_count * (4 + 8) + doc_count * 8
        if idx_size not in (expected, expected + seq_count):  # + one int8 mode per sequence: multimodal
            raise DataError(f"{ipath}: {idx_size} bytes, but {seq_count} sequences and {doc_count} document index "
                            f"entries need {expected} (truncated or not written whole)")
        if doc_count < 1:
            raise DataError(f"{ipath}: an empty document index (it holds at least the leading 0)")
        offset = HEADER_BYTES
        index = np.memmap(ipath, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(index, dtype="<i4", count=seq_count, offset=offset)
        offset += 4 * seq_count
        self.sequence_pointers = np.frombuffer(index, dtype="<i8", count=seq_count, offset=offset)
        offset += 8 * seq_count
        self.document_indices = np.frombuffer(index, dtype="<i8", count=doc_count, offset=offset)
        docs = self.document_indices
        if docs[0] != 0 or docs[-1] != seq_count or (doc_count > 1 and bool((np.diff(docs) < 0).any())):
            raise DataError(f"{ipath}: a broken document index (it must rise from 0 to the sequence count "
                            f"{seq_count})")
        if seq_count and int(self.sequence_lengths.min()) < 0:
            raise DataError(f"{ipath}: a negative sequence length")
        # Token offsets of the sequences: Megatron's writer lays them end to end from byte 0, and
        # the pointers must say so (anything else is a damaged or foreign index).
        starts = np.zeros(seq_count + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, dtype=np.int64, out=starts[1:])
        if not np.array_equal(self.sequence_pointers, starts[:-1] * self.dtype.itemsize):
            raise DataError(f"{ipath}: sequence pointers that are not the sizes laid end to end (a damaged index)")
        self.num_tokens = int(starts[-1])
        bin_size = os.path.getsize(bpath)
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise DataError(f"{bpath}: {bin_size} bytes, but its index says {self.num_tokens} {self.dtype.name} "
                            f"tokens ({self.num_tokens * self.dtype.itemsize} bytes): "
                            + ("truncated" if bin_size < self.num_tokens * self.dtype.itemsize else "too long")
                            + " or not this index's data")
        self.tokens = np.memmap(bpath, dtype=self.dtype.newbyteorder("<"), mode="r", shape=(self.num_tokens,)) \
            if self.num_tokens else np.zeros(0, self.dtype)
        self.document_offsets = starts[docs]  # token offset of each document, and the end
        self.document_lengths = np.diff(self.document_offsets)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sequence_lengths[i])])

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def document(self, d: int) -> np.ndarray:
        return np.asarray(self.tokens[self.document_offsets[d]:self.document_offsets[d + 1]])

    def token_range(self, d: int, lo: int, hi: int) -> np.ndarray:
        """Tokens lo..hi-1 of document d."""
        start = int(self.document_offsets[d])
        return np.asarray(self.tokens[start + lo:start + hi])

    def id_range(self, chunk: int = 1 << 24) -> tuple[int, int] | None:
        """(smallest, largest) token id, read in chunks so that any size is checked at open
        (None: no tokens)."""
        if self.num_tokens == 0:
            return None
        lo, hi = None, None
        for start in range(0, self.num_tokens, chunk):
            block = self.tokens[start:start + chunk]
            bmin, bmax = int(block.min()), int(block.max())
            lo = bmin if lo is None else min(lo, bmin)
            hi = bmax if hi is None else max(hi, bmax)
        return lo, hi


class IndexedDatasetBuilder:
    """Megatron's IndexedDatasetBuilder: `add_item` a sequence, `end_document` after a document's
    sequences (or `add_document`), `finalize(idx_path)` to write the index."""

    def __init__(self, bin_file: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(f"no Megatron dtype code for {self.dtype.name}")
        self.data_file = open(bin_file, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        array = np.asarray(tokens).astype(self.dtype.newbyteorder("<"), copy=False)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    def add_document(self, tokens, lengths) -> None:
        array = np.asarray(tokens).astype(self.dtype.newbyteorder("<"), copy=False)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.end_document()

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_file: str) -> None:
        self.data_file.close()
        lengths = np.asarray(self.sequence_lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(idx_file, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype="<i8").tobytes(order="C"))

    def close(self) -> None:
        self.data_file.close()
