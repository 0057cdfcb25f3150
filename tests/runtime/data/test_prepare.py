"""`specc data prepare`'s library side: tokens are the text's ids with the tokenizer's EOD after
each document, bad input is one clear error and leaves nothing behind, and an existing PREFIX.bin
/.idx is replaced only when specc wrote it."""

from __future__ import annotations

import os

import pytest

from runtime.data import DataError, expand_inputs, open_dataset, prepare


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _tree(path) -> dict:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path)) if (path / name).is_file()}


def test_bad_input_is_one_clear_error_and_leaves_nothing(tmp_path):
    out = str(tmp_path / "out")

    def error(files, tokenizer="byte", **kw):
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(DataError) as e:
            prepare(files, tokenizer, out, **kw)
        assert "\n" not in str(e.value)
        assert sorted(os.listdir(tmp_path)) == before  # nothing written, no temporary left
        return str(e.value)

    with pytest.raises(DataError, match="matches no files"):
        expand_inputs([str(tmp_path / "nothing" / "*.txt")])
    bad = _write(tmp_path / "in" / "latin1.txt", "café".encode("latin-1"))
    assert error([bad]) == f"{bad}: not UTF-8 text (byte 0xe9 at offset 3)"
    gone = str(tmp_path / "in" / "dangling.txt")
    os.symlink(str(tmp_path / "missing"), gone)
    assert error([gone]).startswith(f"{gone}: cannot read (")
    jl = _write(tmp_path / "in" / "x.jsonl", b'{"text": "ok"}\n{"body": "no text"}\n')
    assert error([jl]) == f"{jl}:2: no string field 'text' (set it with --json-keys)"
    empty = _write(tmp_path / "in" / "empty.txt", b"")
    assert "no text" in error([empty])
    ok = _write(tmp_path / "in" / "ok.txt", b"abc")

    class BigVocab:
        name, vocab_size, eod = "big", 70_000, None

        def encode(self, text):
            return [1, 2]

        def describe(self):
            return {"type": "test"}

    assert error([ok], BigVocab(), token_dtype="uint16") == (
        "the tokenizer's vocabulary (70000 tokens) does not fit --token-dtype uint16 (at most 65536 ids)")
    assert error([ok], token_dtype="uint3").startswith("--token-dtype must be")
    assert "no such file" in error([ok], str(tmp_path / "missing.json"))
    (tmp_path / "adir").mkdir()
    with pytest.raises(DataError, match="a directory; the prefix names the files PREFIX.bin and PREFIX.idx"):
        prepare([ok], "byte", str(tmp_path / "adir"))
    with pytest.raises(DataError, match=r"^--output-prefix is empty; the prefix names the files PREFIX.bin"):
        prepare([ok], "byte", "")


def test_only_its_own_files_are_replaced(tmp_path):
    text = _write(tmp_path / "in.txt", b"hello world\n")
    other = _write(tmp_path / "other.txt", b"another text, longer\n")
    out = str(tmp_path / "d" / "c")
    prepare([text], "byte", out)
    prepare([other], "byte", out)  # its own: replaced
    assert bytes(open_dataset(out).document(0).astype("u1")) == b"another text, longer\n"

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "c.bin").write_bytes(b"a Megatron dataset of the user's")
    (mine / "c.idx").write_bytes(b"MMIDIDX\x00\x00...")
    before = _tree(mine)
    with pytest.raises(DataError) as e:
        prepare([text], "byte", str(mine / "c"))
    assert str(e.value) == (f"--output-prefix {mine / 'c'}: {mine / 'c.bin'} exists and `specc data prepare` did "
                            "not write it (no c.specc.json beside it); refusing to replace it (move it away or "
                            "choose another --output-prefix)")
    assert _tree(mine) == before
    (mine / "c.specc.json").write_text('{"format": "someone-elses"}')
    with pytest.raises(DataError, match="did not write it"):
        prepare([text], "byte", str(mine / "c"))


def test_the_cli_prepares_with_megatrons_flags_and_refuses_with_one_line(tmp_path, capsys):
    from specc_cli.main import main

    src = _write(tmp_path / "a.jsonl", b'{"body": "3 7"}\n')
    assert main(["data", "prepare", "--input", src, "--json-keys", "body", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", "100", "--output-prefix", str(tmp_path / "n")]) == 0
    assert "1 documents, 3 tokens (uint16, vocabulary 101, EOD 100 after each document)" in capsys.readouterr().err
    assert open_dataset(str(tmp_path / "n")).document(0).tolist() == [3, 7, 100]
    for argv, message in [
        (["--tokenizer-type", "GPT2BPETokenizer"], "error: --vocab-file is needed: GPT2BPETokenizer reads GPT-2's "
                                                   "vocab.json"),
        (["--tokenizer", "byte", "--tokenizer-type", "ByteTokenizer"], "error: --tokenizer byte and --tokenizer-type "
                                                                       "ByteTokenizer: give one"),
        (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", src], "error: --tiktoken-pattern must be v1 or v2"),
    ]:
        assert main(["data", "prepare", "--input", src, "--output-prefix", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and len(err.splitlines()) == 1, err
    assert not any(n.startswith("x") for n in os.listdir(tmp_path))


def test_ids_outside_the_vocabulary_or_the_dtype_are_refused_not_wrapped(tmp_path):
    # NullTokenizer --vocab-size 100: ids 0..100 (EOD 100), uint16. 70000 as uint16 is 4464, and
    # -1 is 65535: written wrapped they would be other tokens; each is refused, located, nothing written.
    from runtime.data.tokenizer import NullTokenizer

    out = str(tmp_path / "out")

    def error(name, data: bytes, tok, **kw):
        src = _write(tmp_path / "in" / name, data)
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(DataError) as e:
            prepare([src], tok, out, **kw)
        assert sorted(os.listdir(tmp_path)) == before
        assert "\n" not in str(e.value)
        return src, str(e.value)

    src, message = error("a.txt", b"3 70000 7", NullTokenizer(100))
    assert message == (f"{src}: token id 70000 is outside NullTokenizer's vocabulary (ids 0..100) and does not fit "
                       "the dataset's dtype uint16 (0..65535): it would be written as 4464; nothing written")
    src, message = error("b.jsonl", b'{"text": "1 2"}\n{"text": "5 -1"}\n', NullTokenizer(100))
    assert message == (f"{src}:2: token id -1 is outside NullTokenizer's vocabulary (ids 0..100) and does not fit "
                       "the dataset's dtype uint16 (0..65535): it would be written as 65535; nothing written")
    # fits the dtype (int32 asked for) but not the vocabulary: still a different model input
    src, message = error("c.txt", b"101", NullTokenizer(100), token_dtype="int32")
    assert message == f"{src}: token id 101 is outside NullTokenizer's vocabulary (ids 0..100), dataset dtype int32; " \
                      "nothing written"
    src, message = error("d.txt", b"1 " + b"9" * 40, NullTokenizer(100))
    assert message == f"{src}: token id 99999999999999999999... (40 digits) does not fit in 64 bits, let alone in a " \
                      "token file"
    src, message = error("e.txt", b"1 x", NullTokenizer(100))
    assert message == f"{src}: NullTokenizer reads space-separated token ids; the text holds 'x'"

    class Lying:  # a tokenizer that returns ids beyond the vocabulary it claims
        name, vocab_size, eod = "Lying", 300, None

        def encode(self, text):
            return [1, 299, 300]

        def describe(self):
            return {"type": "test"}

    src, message = error("f.txt", b"x", Lying())
    assert message == f"{src}: token id 300 is outside Lying's vocabulary (ids 0..299), dataset dtype uint16; " \
                      "nothing written"
    # the edges are in range
    ok = _write(tmp_path / "ok.txt", b"0 99 100")
    prepare([ok], NullTokenizer(100), out)
    assert open_dataset(out).document(0).tolist() == [0, 99, 100, 100]


def test_inputs_that_are_not_regular_files_are_refused_not_read(tmp_path):
    # a FIFO blocked the read forever, /dev/zero was read until memory ran out: only regular files
    # (or links to them) are read. (The read runs in a thread beside a writer that lets go after
    # 10 s, so that a reader that does open the FIFO fails the test instead of blocking it.)
    import stat
    import threading

    (tmp_path / "in").mkdir()
    ok = _write(tmp_path / "in" / "a.txt", b"abc")
    fifo = str(tmp_path / "in" / "b.txt")
    os.mkfifo(fifo)
    with pytest.raises(DataError) as e:
        expand_inputs([str(tmp_path / "in" / "*.txt")])
    assert str(e.value) == f"--input {fifo}: is a FIFO (named pipe), not a regular file (only regular files are read)"
    os.symlink(ok, str(tmp_path / "link.txt"))
    assert expand_inputs([str(tmp_path / "link.txt")]) == [str(tmp_path / "link.txt")]  # a link to a file is read

    out, outcome = str(tmp_path / "out"), []
    writer = os.open(fifo, os.O_RDWR)
    try:
        os.write(writer, b"def")

        def run():
            try:
                outcome.append(prepare([ok, fifo], "byte", out))
            except BaseException as e:  # noqa: BLE001 - handed to the test
                outcome.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
    finally:
        os.close(writer)
    thread.join()
    assert isinstance(outcome[0], DataError), f"read the FIFO: {outcome[0]!r}"
    assert str(outcome[0]) == f"{fifo}: is a FIFO (named pipe), not a regular file (only regular files are read)"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["in", "link.txt"]  # nothing written, no temporary left


def test_json_lines_nested_too_deeply_or_with_huge_integers_are_one_line(tmp_path):
    import sys

    out = str(tmp_path / "out")
    deep = _write(tmp_path / "deep.jsonl",
                  b'{"text": "ok"}\n{"text": "x", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    with pytest.raises(DataError) as e:
        prepare([deep], "byte", out)
    assert str(e.value) == (f"{deep}:2: JSON nested too deeply to read (more than Python's recursion limit, "
                            f"{sys.getrecursionlimit()} levels)")
    big = _write(tmp_path / "big.jsonl", b'{"text": "x", "n": ' + b"1" * 100_000 + b"}\n")
    with pytest.raises(DataError) as e:
        prepare([big], "byte", out)
    assert str(e.value) == f"{big}:1: cannot read its JSON (an integer of more than {sys.get_int_max_str_digits()} " \
                           "digits)"
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl", "deep.jsonl"]


def test_a_tokenizer_pattern_that_backtracks_without_end_stops_in_bounded_time(tmp_path, capsys):
    # A tokenizer.json whose Split pattern (a+)+$ backtracks exponentially: each run of 20 a's and
    # a b costs Oniguruma about 2^21 steps, so 300 of them took 33 s and each such line adds 0.1 s
    # without end (30 a's at once made it panic: a Rust backtrace). The tokenizing runs in a worker
    # under the time limit (1 s here, plus 1 s per 10,000 characters); prepare runs in a thread, so
    # a hang fails the test after 30 s.
    import threading
    import time

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from runtime.data import HuggingFaceTokenizer

    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"(a+)+$"), behavior="isolated")
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.patterns == ("(a+)+$",)
    fine = _write(tmp_path / "in" / "a.jsonl", b"".join(b'{"text": "a b %d"}\n' % i for i in range(600)))
    slow = _write(tmp_path / "in" / "b.txt", b"aaaaaaaaaaaaaaaaaaaab " * 300)
    panics = _write(tmp_path / "in" / "c.txt", b"a" * 30 + b"b")
    out = str(tmp_path / "out")
    before = sorted(os.listdir(tmp_path))

    def run(files, time_limit=1):
        outcome = []

        def target():
            try:
                outcome.append(prepare(files, tok, out, time_limit=time_limit))
            except BaseException as e:  # noqa: BLE001 - handed to the test
                outcome.append(e)

        start = time.monotonic()
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(30)
        assert outcome, "tokenizing did not stop within 30 s"
        return outcome[0], time.monotonic() - start

    error, seconds = run([slow])
    assert isinstance(error, DataError), error
    assert str(error).startswith(f"{slow}: tokenizing stopped at its time limit (")
    assert str(error).endswith(f"characters: --tokenize-time-limit 1 s plus 1 s per 10,000 characters); the "
                               f"pattern '(a+)+$' of HuggingFaceTokenizer {tok.path} backtracks catastrophically on it")
    assert seconds < 10 and "\n" not in str(error)
    error, _ = run([panics], time_limit=20)  # Oniguruma's retry limit, not ours: well within it
    assert str(error) == (f"{panics}: the tokenizer failed on it (Onig: Regex search error: retry-limit-in-match "
                          f"over): the pattern '(a+)+$' of HuggingFaceTokenizer {tok.path} backtracks "
                          "catastrophically on it")
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no temporary left
    # the command: the same line, exit 2; the limit is a positive number of seconds
    from specc_cli.main import main

    argv = ["data", "prepare", "--input", slow, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            tok.path, "--output-prefix", out, "--tokenize-time-limit"]
    assert main(argv + ["1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {slow}: tokenizing stopped at its time limit (") and len(err.splitlines()) == 1
    assert "the pattern '(a+)+$' of HuggingFaceTokenizer" in err
    assert main(argv + ["0"]) == 2
    assert capsys.readouterr().err == "error: --tokenize-time-limit must be a positive number of seconds, got 0.0\n"
    assert sorted(os.listdir(tmp_path)) == before
    # the documents before, 600 lines in two batches to the worker, are the tokenizer's ids in order
    meta, _ = run([fine], time_limit=20)
    assert meta["num_documents"] == 600
    data = open_dataset(out)
    assert [data.document(i).tolist() for i in (0, 599)] == [hf.encode("a b 0").ids, hf.encode("a b 599").ids]
