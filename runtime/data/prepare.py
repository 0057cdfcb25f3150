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
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output))}.tmp-", dir=parent)
    except OSError as e:
        raise DataError(f"--output {output}: cannot write there ({e.strerror or e})") from None
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
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            f.write(MARKER_TEXT)
        _check_output(output)  # again: it may have changed while we tokenized
        _swap(tmp, output)
    except OSError as e:  # reading inputs is checked in _documents: this is the output's
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"--output {output}: cannot write it ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if log is not None:
        log(f"wrote {output}: {meta['num_documents']} documents, {meta['num_tokens']} tokens ({token_dtype}, "
            f"vocabulary {tok.vocab_size}) from {len(files)} files in {time.monotonic() - start:.1f}s")
    return meta


# Every dataset folder prepare writes holds MARKER: prepare replaces only such folders (or an
# empty one), and only while they hold nothing but what it writes; never a user's files.
MARKER = ".specc-output"
MARKER_TEXT = "written by `specc data prepare`; preparing into this folder again replaces it\n"
OWN = frozenset((TOKENS, DOCUMENTS, META, MARKER))


def _check_output(output: str) -> None:
    hint = "move it away or choose another --output"
    if os.path.islink(output) or (os.path.exists(output) and not os.path.isdir(output)):
        raise DataError(f"--output {output}: exists and is not a directory that specc data prepare wrote ({hint})")
    if not os.path.isdir(output):
        return
    try:
        entries = sorted(os.listdir(output))
    except OSError as e:
        raise DataError(f"--output {output}: cannot read it ({e.strerror or e})") from None
    if not entries:
        return
    if MARKER in entries:
        marked = _read(os.path.join(output, MARKER)) == MARKER_TEXT
    else:  # prepared before datasets were marked: only its three files, and its metadata says so
        try:
            marked = set(entries) <= OWN and json.loads(_read(os.path.join(output, META)) or "").get("format") == FORMAT
        except (ValueError, AttributeError):
            marked = False
    if not marked:
        raise DataError(f"--output {output}: a non-empty directory that is not a prepared dataset; refusing to "
                        f"replace it (specc data prepare did not write it: it has no {MARKER}; {hint})")
    foreign = [e for e in entries if e not in OWN]
    if foreign:
        raise DataError(f"--output {output}: holds {foreign[0]}, which specc data prepare did not write; refusing "
                        "to replace the directory (move it out first)")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _swap(tmp: str, output: str) -> None:
    """Rename the finished `tmp` to `output`; an old dataset there is renamed away first and
    removed only once the new one is in place (put back if that fails)."""
    if not os.path.lexists(output):
        os.replace(tmp, output)
        return
    old = tmp + ".old"
    os.rename(output, old)
    try:
        os.rename(tmp, output)
    except BaseException:
        os.rename(old, output)
        raise
    shutil.rmtree(old, ignore_errors=True)
