"""The on-disk token format that `specc data prepare` writes and training memory-maps
(Megatron's .bin/.idx idea):

    DIR/tokens.bin      every document's token ids, concatenated, raw little-endian (dtype below)
    DIR/documents.npy   int64 offsets, one more than the documents: document i is
                        tokens[offsets[i]:offsets[i+1]]
    DIR/dataset.json    format, version, tokenizer, vocab_size, dtype, counts, the source files
"""

from __future__ import annotations

import json
import os

import numpy as np

from .errors import DataError

FORMAT = "specc-tokens"
VERSION = 1
TOKENS, DOCUMENTS, META = "tokens.bin", "documents.npy", "dataset.json"
DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "int32": np.int32}


def dtype_capacity(name: str) -> int:
    """How many distinct token ids a dtype holds."""
    return int(np.iinfo(DTYPES[name]).max) + 1


def smallest_dtype(vocab_size: int) -> str:
    for name in ("uint8", "uint16", "int32"):
        if vocab_size <= dtype_capacity(name):
            return name
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit any token dtype (int32 at most)")


class IndexedTokens:
    """A prepared dataset, memory-mapped: nothing is read until a window is sliced."""

    def __init__(self, directory: str):
        self.directory = directory
        meta_path = os.path.join(directory, META)
        if not os.path.isfile(meta_path):
            raise DataError(f"--data-path {directory}: no {META} (prepare one with `specc data prepare`)")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{meta_path}: unreadable ({e})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise DataError(f"{meta_path}: not a {FORMAT} v{VERSION} dataset (prepare it again)")
        if meta.get("dtype") not in DTYPES:
            raise DataError(f"{meta_path}: unknown token dtype {meta.get('dtype')!r}")
        self.meta = meta
        self.vocab_size = int(meta["vocab_size"])
        self.dtype = DTYPES[meta["dtype"]]
        try:
            self.offsets = np.load(os.path.join(directory, DOCUMENTS))
        except (OSError, ValueError) as e:
            raise DataError(f"{directory}/{DOCUMENTS}: unreadable ({e})") from None
        tokens_path = os.path.join(directory, TOKENS)
        size = os.path.getsize(tokens_path) if os.path.isfile(tokens_path) else -1
        n = int(meta["num_tokens"])
        if size != n * np.dtype(self.dtype).itemsize or self.offsets.ndim != 1 or len(self.offsets) < 1 \
                or int(self.offsets[-1]) != n or int(self.offsets[0]) != 0:
            raise DataError(f"{directory}: {TOKENS} and {DOCUMENTS} disagree with {META} (prepare it again)")
        self.tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r", shape=(n,)) if n else np.zeros(0, self.dtype)

    def first_token_outside(self, vocab_size: int, chunk: int = 1 << 24):
        """(position, id) of the first token id not in [0, vocab_size), or None: read in chunks,
        so that a dataset of any size is checked at load and not found out mid-run."""
        for start in range(0, self.num_tokens, chunk):
            block = self.tokens[start:start + chunk]
            if int(block.max()) < vocab_size and int(block.min()) >= 0:
                continue
            i = int(np.flatnonzero((block >= vocab_size) | (block < 0))[0])
            return start + i, int(block[i])
        return None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1
