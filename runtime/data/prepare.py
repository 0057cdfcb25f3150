"""Tokenize text files into the memory-mapped format of indexed.py (Megatron's preprocess_data).

Each plain text file is one document; a `.jsonl` file holds one document per line, in the
field named by `json_key` (Megatron's loose-JSON input). Files are read in sorted path order, so
the result is the same on every machine. The output appears whole or not at all: it is written
into a temporary directory beside DIR and renamed into place.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
import tempfile
import time

import numpy as np

from .errors import DataError
from .indexed import DOCUMENTS, DTYPES, FORMAT, META, TOKENS, VERSION, dtype_capacity, smallest_dtype
from .tokenizer import build_tokenizer


def stdlib_files(limit: int | None = None) -> list:
    """The embedded default corpus: the Python standard library's own top-level sources,
    present in every Python installation."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return files[:limit] if limit else files


def expand_inputs(patterns: list) -> list:
    files = set()
    for pattern in patterns:
        matched = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if not os.path.isdir(p)]
        if not matched:
            raise DataError(f"--input {pattern!r} matches no files")
        files.update(matched)
    return sorted(files)


def _documents(path: str, json_key: str):
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    if not path.endswith(".jsonl"):
        yield text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not a JSON object per line ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
            raise DataError(f"{path}:{number}: no string field {json_key!r} (set it with --json-key)")
        yield record[json_key]


def prepare(files: list, tokenizer, output: str, token_dtype: str = "auto", json_key: str = "text",
            log=None) -> dict:
    """Tokenize `files` into `output` with a tokenizer ('byte', a tokenizer.json path, or an
    object with vocab_size/name/encode/describe); returns the metadata written to dataset.json."""
    if not files:
        raise DataError("no input files")
    tok = build_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if token_dtype == "auto":
        token_dtype = smallest_dtype(tok.vocab_size)
    if token_dtype not in DTYPES:
        raise DataError(f"--token-dtype must be auto or one of {', '.join(DTYPES)}, got {token_dtype!r}")
    if tok.vocab_size > dtype_capacity(token_dtype):
        raise DataError(f"the tokenizer's vocabulary ({tok.vocab_size} tokens) does not fit --token-dtype "
                        f"{token_dtype} (at most {dtype_capacity(token_dtype)} ids)")
    _check_output(output)
    dtype = DTYPES[token_dtype]
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output))}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the dataset is not
    start = time.monotonic()
    try:
        offsets = [0]
        sources = []
        with open(os.path.join(tmp, TOKENS), "wb") as out:
            for path in files:
                n_file = 0
                for text in _documents(path, json_key):
                    ids = np.frombuffer(tok.encode(text), dtype=np.uint8) if tok.name == "byte" \
                        else np.asarray(tok.encode(text), dtype=np.int64)
                    if len(ids) == 0:
                        continue
                    out.write(ids.astype(dtype, copy=False).tobytes())
                    offsets.append(offsets[-1] + len(ids))
                    n_file += len(ids)
                sources.append({"path": os.path.abspath(path), "tokens": n_file})
        if offsets[-1] == 0:
            raise DataError("the input files hold no text (every document is empty)")
        np.save(os.path.join(tmp, DOCUMENTS), np.asarray(offsets, dtype=np.int64))
        meta = {"format": FORMAT, "version": VERSION, "tokenizer": tok.describe(), "vocab_size": tok.vocab_size,
                "dtype": token_dtype, "num_tokens": offsets[-1], "num_documents": len(offsets) - 1,
                "json_key": json_key, "sources": sources}
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        if os.path.isdir(output):
            shutil.rmtree(output)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if log is not None:
        log(f"wrote {output}: {meta['num_documents']} documents, {meta['num_tokens']} tokens ({token_dtype}, "
            f"vocabulary {tok.vocab_size}) from {len(files)} files in {time.monotonic() - start:.1f}s")
    return meta


def _check_output(output: str) -> None:
    if os.path.exists(output) and not os.path.isdir(output):
        raise DataError(f"--output {output}: exists and is not a directory")
    if os.path.isdir(output) and os.listdir(output) and not os.path.isfile(os.path.join(output, META)):
        raise DataError(f"--output {output}: a non-empty directory that is not a prepared dataset; "
                        "refusing to replace it")
