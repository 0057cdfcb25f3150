"""`specc data prepare --output DIR` replaces only a dataset it wrote itself (marked, holding
nothing but its own files): a user's directory, even one that holds a `dataset.json`, is refused
with one line and left exactly as it was."""

from __future__ import annotations

import json
import os

import pytest

from runtime.data import DataError, IndexedTokens, prepare
from runtime.data.prepare import MARKER, MARKER_TEXT

OWN = sorted([".specc-output", "dataset.json", "documents.npy", "tokens.bin"])


def _tree(path) -> dict:
    found = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            found[os.path.relpath(full, path)] = open(full, "rb").read()
    return found


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("hello world\n")
    return str(path)


def _refused(text, out) -> str:
    with pytest.raises(DataError) as e:
        prepare([text], "byte", str(out))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_user_directory_with_a_dataset_json_is_refused_and_untouched(tmp_path, text):
    out = tmp_path / "out"
    out.mkdir()
    (out / "dataset.json").write_text('{"mine": true}\n')
    (out / "thesis.tex").write_text("years of work\n")
    before = _tree(tmp_path)
    message = _refused(text, out)
    assert message == (f"--output {out}: a non-empty directory that is not a prepared dataset; refusing to replace "
                       f"it (specc data prepare did not write it: it has no {MARKER}; move it away or choose "
                       "another --output)")
    assert _tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["in.txt", "out"]  # no temporary left

    # a real (marked) dataset that someone put a file of their own into: refused too
    (out / "thesis.tex").unlink()
    (out / "dataset.json").unlink()
    prepare([text], "byte", str(out))
    assert sorted(os.listdir(out)) == OWN and (out / MARKER).read_text() == MARKER_TEXT
    (out / "notes.md").write_text("keep me\n")
    before = _tree(tmp_path)
    assert _refused(text, out) == (f"--output {out}: holds notes.md, which specc data prepare did not write; "
                                   "refusing to replace the directory (move it out first)")
    assert _tree(tmp_path) == before

    # a file where the directory should go
    target = tmp_path / "file"
    target.write_text("x\n")
    assert _refused(text, target).startswith(f"--output {target}: exists and is not a directory")
    assert target.read_text() == "x\n"


def test_its_own_datasets_are_replaced_also_those_from_before_the_marker(tmp_path, text):
    out = tmp_path / "out"
    prepare([text], "byte", str(out))
    other = tmp_path / "other.txt"
    other.write_text("another text, longer\n")
    prepare([str(other)], "byte", str(out))
    assert sorted(os.listdir(out)) == OWN and bytes(IndexedTokens(str(out)).tokens) == b"another text, longer\n"
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "other.txt", "out"]  # the old one is gone, no temporary

    (out / MARKER).unlink()  # as prepared before datasets were marked: its three files, its format
    prepare([text], "byte", str(out))
    assert sorted(os.listdir(out)) == OWN and bytes(IndexedTokens(str(out)).tokens) == b"hello world\n"

    (out / MARKER).unlink()
    meta = json.loads((out / "dataset.json").read_text())
    (out / "dataset.json").write_text(json.dumps({**meta, "format": "someone-elses"}))
    assert "not a prepared dataset" in _refused(text, out)  # unmarked and not our format: not ours

    empty = tmp_path / "empty"
    empty.mkdir()
    prepare([text], "byte", str(empty))
    assert sorted(os.listdir(empty)) == OWN


def test_the_cli_refuses_with_one_line_and_exit_2(tmp_path, text, capsys):
    from specc.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "dataset.json").write_text("{}\n")
    (out / "mine.txt").write_text("mine\n")
    assert main(["data", "prepare", "--input", text, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --output {out}: a non-empty directory that is not a prepared dataset")
    assert len(err.splitlines()) == 1 and sorted(os.listdir(out)) == ["dataset.json", "mine.txt"]
