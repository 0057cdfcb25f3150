"""Tokenize text files into Megatron's indexed dataset (indexed.py), as Megatron's
tools/preprocess_data.py does: PREFIX.bin and PREFIX.idx, one sequence per document, the
tokenizer's end-of-document id appended to each document (--append-eod, on by default here).
Beside them PREFIX.specc.json records the tokenizer, the counts and the source files (Megatron
neither writes nor needs it; specc reads datasets without it too).

Each plain text file is one document; a `.jsonl` file holds one document per line, in the
field named by `json_key` (Megatron's loose-JSON input). Files are read in sorted path order, so
the result is the same on every machine. The files are written under temporary names beside
PREFIX and renamed into place when complete; an existing PREFIX.bin/.idx is replaced only when
its PREFIX.specc.json says that `specc data prepare` wrote it.
"""

from __future__ import annotations

import glob
import json
import os
import stat
import sys
import sysconfig
import tempfile
import time

import numpy as np

from ..files import kind_of_mode, not_a_file, replace
from .encode import DEFAULT_SECONDS, Encoder, check_time_limit
from .errors import DataError
from .indexed import TOKEN_DTYPES, IndexedDatasetBuilder, bin_path, dtype_capacity, idx_path, optimal_dtype
from .tokenizer import build_tokenizer

FORMAT = "specc-prepare"
VERSION = 1
SIDECAR = ".specc.json"


def sidecar_path(prefix: str) -> str:
    return prefix + SIDECAR


def read_sidecar(prefix: str) -> dict | None:
    """What `specc data prepare` recorded beside PREFIX (None: not written by it)."""
    try:
        with open(sidecar_path(prefix), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def stdlib_files(limit: int | None = None) -> list:
    """The embedded default corpus: the Python standard library's own top-level sources,
    present in every Python installation."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return files[:limit] if limit else files


def expand_inputs(patterns: list) -> list:
    """The files the --input globs match, sorted; folders they match are passed over. Only regular
    files (or links to them) are read: a FIFO would block the read forever, a device such as
    /dev/zero would be read until memory runs out."""
    files = set()
    for pattern in patterns:
        matched = [p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if not os.path.isdir(p)]
        if not matched:
            raise DataError(f"--input {pattern!r} matches no files")
        for path in matched:
            try:
                mode = os.stat(path).st_mode
            except OSError:
                continue  # a dangling link: the read names it
            if not stat.S_ISREG(mode):
                raise DataError(f"--input {path}: is {kind_of_mode(mode)}, not a regular file (only regular files "
                                "are read)")
        files.update(matched)
    return sorted(files)


def _read_regular(path: str) -> bytes:
    """The bytes of a regular file (or a link to one). Opened without blocking and checked before
    reading, so that a FIFO or a device put there after expand_inputs is refused, not read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataError(f"{path}: is {kind_of_mode(mode)}, not a regular file (only regular files are read)")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = None
            return f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        if fd is not None:
            os.close(fd)


def _documents(path: str, json_key: str):
    """(where, text) of each document of a file: `where` names it in errors (PATH, or PATH:LINE)."""
    raw = _read_regular(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    if not path.endswith((".jsonl", ".json")):
        yield path, text
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not a JSON object per line ({e.msg})") from None
        except RecursionError:  # json's decoder recurses once per level of nesting
            raise DataError(f"{path}:{number}: JSON nested too deeply to read (more than Python's recursion "
                            f"limit, {sys.getrecursionlimit()} levels)") from None
        except ValueError as e:  # an integer of more digits than Python converts
            limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else None
            what = f"an integer of more than {limit} digits" if limit and "digits" in str(e) else str(e)[:200]
            raise DataError(f"{path}:{number}: cannot read its JSON ({what})") from None
        if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
            raise DataError(f"{path}:{number}: no string field {json_key!r} (set it with --json-keys)")
        yield f"{path}:{number}", record[json_key]


def prepare(files: list, tokenizer, output_prefix: str, token_dtype: str = "auto", json_key: str = "text",
            append_eod: bool = True, log=None, time_limit: float = DEFAULT_SECONDS) -> dict:
    """Tokenize `files` into OUTPUT_PREFIX.bin/.idx with a tokenizer (a --tokenizer-type name,
    'byte', a tokenizer.json path, or an object with vocab_size/eod/name/encode/describe);
    returns what PREFIX.specc.json records. Tokenizing may take `time_limit` seconds plus one per
    encode.CHARS_PER_SECOND characters (encode.py: a pattern that backtracks without end stops)."""
    if not files:
        raise DataError("no input files")
    time_limit = check_time_limit(time_limit)
    tok = build_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if token_dtype == "auto":
        dtype = np.dtype(optimal_dtype(tok.vocab_size))
    elif token_dtype in TOKEN_DTYPES:
        dtype = np.dtype(TOKEN_DTYPES[token_dtype])
    else:
        raise DataError(f"--token-dtype must be auto or one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}")
    if tok.vocab_size > dtype_capacity(dtype):
        raise DataError(f"the tokenizer's vocabulary ({tok.vocab_size} tokens) does not fit --token-dtype "
                        f"{dtype.name} (at most {dtype_capacity(dtype)} ids)")
    _check_output(output_prefix)
    parent = os.path.dirname(os.path.abspath(output_prefix))
    base = os.path.basename(output_prefix)
    try:
        os.makedirs(parent, exist_ok=True)
        temps = {}
        for suffix in (".bin", ".idx", SIDECAR):
            fd, temps[suffix] = tempfile.mkstemp(prefix=f".{base}{suffix}.tmp-", dir=parent)
            os.close(fd)
    except OSError as e:
        raise DataError(f"--output-prefix {output_prefix}: cannot write there ({e.strerror or e})") from None
    eod = tok.eod if append_eod else None
    start = time.monotonic()
    try:
        umask = os.umask(0)
        os.umask(umask)
        for path in temps.values():
            os.chmod(path, 0o666 & ~umask)  # mkstemp makes them private; a dataset is not
        builder = IndexedDatasetBuilder(temps[".bin"], dtype)
        sources, num_tokens = [], 0
        as_bytes = isinstance(tok.encode(""), bytes)  # the byte tokenizer's ids are the text's bytes
        try:
            with Encoder(tok, as_bytes, time_limit) as encoder:
                for path in files:
                    n_file = 0
                    for where, ids in encoder.encoded(_documents(path, json_key)):
                        _check_ids(ids, tok, dtype, where)
                        if eod is not None:
                            ids = np.append(ids.astype(np.int64), eod)
                        if len(ids) == 0:
                            continue
                        builder.add_item(ids)
                        builder.end_document()
                        n_file += len(ids)
                    sources.append({"path": os.path.abspath(path), "tokens": n_file})
                    num_tokens += n_file
        finally:
            builder.close()
        if num_tokens == 0:
            raise DataError("the input files hold no text (every document is empty)")
        builder.finalize(temps[".idx"])
        meta = {"format": FORMAT, "version": VERSION, "tokenizer": tok.describe(), "vocab_size": tok.vocab_size,
                "eod": eod, "dtype": dtype.name, "num_tokens": num_tokens,
                "num_documents": len(builder.document_indices) - 1, "json_key": json_key, "sources": sources}
        with open(temps[SIDECAR], "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        _check_output(output_prefix)  # again: it may have changed while we tokenized
        # .bin first, the sidecar last: a reader checks the index against the data file, so a
        # rename cut short is found, never read as a dataset.
        replace(temps[".bin"], bin_path(output_prefix))  # each only over a regular file (checked just before)
        replace(temps[".idx"], idx_path(output_prefix))
        replace(temps[SIDECAR], sidecar_path(output_prefix))
    except OSError as e:  # reading inputs is checked in _documents: this is the output's
        _remove(temps.values())
        raise DataError(f"--output-prefix {output_prefix}: cannot write it ({e.strerror or e})") from None
    except BaseException:
        _remove(temps.values())
        raise
    if log is not None:
        eod_note = f", EOD {eod} after each document" if eod is not None else \
            (", no EOD (the tokenizer has none)" if append_eod else ", no EOD")
        log(f"wrote {output_prefix}.bin/.idx: {meta['num_documents']} documents, {num_tokens} tokens ({dtype.name}, "
            f"vocabulary {tok.vocab_size}{eod_note}) from {len(files)} files in {time.monotonic() - start:.1f}s")
    return meta


def _check_ids(ids: np.ndarray, tok, dtype: np.dtype, where: str) -> None:
    """Every id is in the tokenizer's vocabulary and fits `dtype`: one out of range would be written
    wrapped around (70000 as uint16 is 4464), a different token inside the vocabulary."""
    if ids.size == 0:
        return
    limit = min(int(tok.vocab_size), dtype_capacity(dtype))
    if int(ids.min()) >= 0 and int(ids.max()) < limit:
        return
    bad = int(ids[(ids < 0) | (ids >= limit)][0])
    name = getattr(tok, "name", "") or "the tokenizer"
    capacity = dtype_capacity(dtype)
    fits = 0 <= bad < capacity
    raise DataError(f"{where}: token id {bad} is outside {name}'s vocabulary (ids 0..{int(tok.vocab_size) - 1})"
                    + (f", dataset dtype {dtype.name}" if fits else
                       f" and does not fit the dataset's dtype {dtype.name} (0..{capacity - 1}): it would be "
                       f"written as {int(np.array(bad).astype(dtype))}")
                    + "; nothing written")


def _remove(paths) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _check_output(prefix: str) -> None:
    """PREFIX.bin and PREFIX.idx are written only where nothing is, or where specc wrote them."""
    hint = "move it away or choose another --output-prefix"
    if not prefix:
        raise DataError("--output-prefix is empty; the prefix names the files PREFIX.bin and PREFIX.idx "
                        "(e.g. ./corpus_text_document)")
    if not os.path.basename(prefix) or os.path.isdir(prefix):
        raise DataError(f"--output-prefix {prefix}: a directory; the prefix names the files PREFIX.bin and "
                        f"PREFIX.idx (e.g. {os.path.join(prefix.rstrip('/') or '.', 'corpus_text_document')})")
    present = [p for p in (bin_path(prefix), idx_path(prefix), sidecar_path(prefix)) if os.path.lexists(p)]
    for path in present:
        what = not_a_file(path)
        if what is not None:
            raise DataError(f"--output-prefix {prefix}: {path} is {what}, not a regular file: only regular files "
                            f"are replaced, and it is left as it is ({hint})")
    if present and read_sidecar(prefix) is None:
        first = present[0]
        raise DataError(f"--output-prefix {prefix}: {first} exists and `specc data prepare` did not write it (no "
                        f"{os.path.basename(sidecar_path(prefix))} beside it); refusing to replace it ({hint})")
