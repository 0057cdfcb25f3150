"""Token ids of documents, under a time budget. A tokenizer.json's split and replace patterns are
regular expressions that the file's author chose, run by a backtracking engine (Oniguruma, in
`tokenizers`): one such as `(a+)+$` takes exponential time on a line of a's, and neither the
engine nor Python can interrupt it. So a tokenizer whose running time its own code does not bound
(every one but ByteTokenizer and NullTokenizer, whose encode is linear Python) runs in a worker
process forked from this one, and the worker is killed when the tokenizing time so far exceeds
`seconds` plus one second per `chars_per_second` characters so far: a stop in bounded time with a
one-line error naming the document, the tokenizer's file and its patterns, never a hang. A panic
in the tokenizer's Rust code (Oniguruma's retry limit) is the same kind of one-line error."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np

from .errors import DataError

DEFAULT_SECONDS = 10.0  # --tokenize-time-limit
# The slowest tokenizer measured here (the tests' GPT-2 BPE, through `tokenizers`, on a busy
# 2-core machine) encodes 500,000 characters a second: the budget is 50 times slower than that.
CHARS_PER_SECOND = 10_000
BATCH_DOCUMENTS, BATCH_CHARS = 512, 1 << 20  # documents sent to the worker at once


def check_time_limit(seconds) -> float:
    """--tokenize-time-limit: a positive, finite number of seconds."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < float("inf"):
        raise DataError(f"--tokenize-time-limit must be a positive number of seconds, got {seconds}")
    return value


def token_ids(tok, text: str, as_bytes: bool, where: str) -> np.ndarray:
    """The ids of one document, as an array (int64, or uint8 for the byte tokenizer)."""
    try:
        ids = tok.encode(text)
    except DataError as e:  # the tokenizer's own complaint (NullTokenizer: not ids), located here
        raise DataError(f"{where}: {e}") from None
    if as_bytes:
        return np.frombuffer(ids, dtype=np.uint8)
    try:
        return np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an id beyond 64 bits: found one by one, on this error path only
        bad = next(i for i in ids if not -2 ** 63 <= int(i) < 2 ** 63)
        digits = str(bad)
        shown = digits if len(digits) <= 30 else f"{digits[:20]}... ({len(digits)} digits)"
        raise DataError(f"{where}: token id {shown} does not fit in 64 bits, let alone in a token file") from None


def _suspects(tok) -> str:
    """What to blame for a tokenizer that ran too long or panicked: its file and its patterns."""
    files = getattr(tok, "files", None) or {}
    source = next(iter(files.values()), None)
    name = getattr(tok, "name", "") or type(tok).__name__
    patterns = list(getattr(tok, "patterns", ()) or ())
    where = f"{name} {source}" if source else name
    if not patterns:
        return f"the tokenizer ({where}) does not finish on it"
    if len(patterns) == 1:
        return f"the pattern {patterns[0]!r} of {where} backtracks catastrophically on it"
    shown = ", ".join(repr(p) for p in patterns)
    return f"one of the patterns {shown} of {where} backtracks catastrophically on it"


def _serve(tok, conn, as_bytes: bool) -> None:
    """The worker: batches of (where, text) in, one (kind, value) per document out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it; Ctrl-C is the parent's
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # a Rust panic prints its backtrace to stderr: the parent reports it in one line
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        for where, text in batch:
            try:
                conn.send(("ids", token_ids(tok, text, as_bytes, where)))
            except DataError as e:
                conn.send(("error", str(e)))
            except Exception as e:  # noqa: BLE001 - a custom tokenizer's own error: raised in the parent
                try:
                    conn.send(("raise", e))
                except Exception:  # noqa: BLE001 - not picklable
                    conn.send(("raise", RuntimeError(f"{type(e).__name__}: {e}")))
            except BaseException as e:  # noqa: BLE001 - pyo3's PanicException: a Rust panic
                message = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                conn.send(("panic", message))


class Encoder:
    """(where, ids) of the documents of an iterator, in order, each ids from `tok`: in this process
    for tokenizers whose encode is linear Python (`linear_time`), else in a forked worker under the
    time budget. Use as a context manager: leaving it stops the worker."""

    def __init__(self, tok, as_bytes: bool, seconds: float = DEFAULT_SECONDS,
                 chars_per_second: float = CHARS_PER_SECOND):
        self.tok, self.as_bytes = tok, as_bytes
        self.seconds, self.chars_per_second = check_time_limit(seconds), float(chars_per_second)
        self.in_process = getattr(tok, "linear_time", False) or "fork" not in multiprocessing.get_all_start_methods()
        self.chars, self.busy = 0, 0.0  # characters sent so far, seconds spent waiting on the worker
        self.proc = self.conn = None
        self.pending = 0  # results of the batch in flight not yet read

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encoded(self, documents):
        """Yields (where, ids) for each (where, text) of `documents`. An error raised by the iterator
        (a bad line of a file) comes after the documents before it: their errors come first."""
        batch, size = [], 0
        it = iter(documents)
        while True:
            try:
                doc = next(it)
            except StopIteration:
                yield from self._run(batch)
                return
            except BaseException:
                yield from self._run(batch)
                raise
            batch.append(doc)
            size += len(doc[1])
            if len(batch) >= BATCH_DOCUMENTS or size >= BATCH_CHARS:
                yield from self._run(batch)
                batch, size = [], 0

    def _run(self, batch: list):
        if self.in_process:
            for where, text in batch:
                yield where, token_ids(self.tok, text, self.as_bytes, where)
            return
        if not batch:
            return
        self._start()
        self.conn.send(batch)
        self.pending = len(batch)
        for where, text in batch:
            self.chars += len(text)
            budget = self.seconds + self.chars / self.chars_per_second
            start = time.monotonic()
            ready = self.conn.poll(max(budget - self.busy, 0.0))
            self.busy += time.monotonic() - start
            if not ready:
                self._kill()
                raise DataError(f"{where}: tokenizing stopped at its time limit ({self.busy:.1f} s for "
                                f"{self.chars:,} characters: --tokenize-time-limit {self.seconds:g} s plus 1 s per "
                                f"{self.chars_per_second:,.0f} characters); {_suspects(self.tok)}")
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                code = self._kill()
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                raise DataError(f"{where}: the tokenizer's process ended ({how}) while tokenizing it; "
                                f"{_suspects(self.tok)}") from None
            self.pending -= 1
            if kind == "ids":
                yield where, value
            elif kind == "error":
                raise DataError(value)
            elif kind == "panic":
                raise DataError(f"{where}: the tokenizer failed on it ({value}): {_suspects(self.tok)}")
            else:
                raise value

    def _start(self) -> None:
        if self.proc is not None:
            return
        ctx = multiprocessing.get_context("fork")  # the tokenizer object as it is, nothing pickled
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(self.tok, child, self.as_bytes), daemon=True)
        self.proc.start()
        child.close()

    def _kill(self):
        """Stops the worker now; its exit code (negative: the signal)."""
        if self.proc is None:
            return None
        self.proc.kill()
        self.proc.join()
        code = self.proc.exitcode
        self.conn.close()
        self.proc = self.conn = None
        return code

    def close(self) -> None:
        """Stops the worker: at once when results are left unread (an error stopped the run), else
        after it reads the end of the input."""
        if self.proc is None:
            return
        if not self.pending:
            try:
                self.conn.send(None)
                self.proc.join(timeout=5)
            except OSError:
                pass
        self._kill()
