"""The compiler's writers (`specc graph -o`, `specc plot -o`, specc.files) replace only regular
files: a FIFO, a symbolic link (even to a regular file), a socket or a folder at the path is a
one-line error naming it and what it is, and it is left exactly as it was. The runtime's copy of
the check (runtime/files.py; specc cannot import the runtime) must say the same of every kind."""

from __future__ import annotations

import os
import socket
import stat
import tempfile

import pytest

from specc.errors import SpecError
from specc.files import atomic_write, atomic_write_text, check_replaceable, not_a_file
from specc_cli.main import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


@pytest.fixture
def things(tmp_path):
    """{name: path} of each kind of thing a writer may meet (no device nodes: tests make none)."""
    out = {"absent": str(tmp_path / "absent"), "file": str(tmp_path / "file"), "folder": str(tmp_path / "folder"),
           "fifo": str(tmp_path / "fifo"), "link": str(tmp_path / "link"), "dangling": str(tmp_path / "dangling")}
    (tmp_path / "file").write_text("the user's file\n")
    os.mkdir(out["folder"])
    os.mkfifo(out["fifo"])
    (tmp_path / "target").write_text("the link's target\n")
    os.symlink(str(tmp_path / "target"), out["link"])
    os.symlink(str(tmp_path / "nowhere"), out["dangling"])
    return out


def _snapshot(path: str):
    """What is at `path`, enough to tell that nothing changed: its kind, a link's target and the
    target's bytes, a file's bytes."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        return ("link", target, open(target, "rb").read() if os.path.isfile(target) else None)
    if stat.S_ISREG(st.st_mode):
        return ("file", open(path, "rb").read())
    return (stat.S_IFMT(st.st_mode), st.st_ino)


EXPECTED = {"absent": None, "file": None, "folder": "a folder", "fifo": "a FIFO (named pipe)",
            "link": "a symbolic link (to {target})", "dangling": "a symbolic link (to {nowhere})"}


def test_the_compiler_and_the_runtime_name_each_kind_alike(things, tmp_path):
    from runtime.files import not_a_file as runtime_not_a_file

    for name, path in things.items():
        want = EXPECTED[name]
        want = want and want.format(target=tmp_path / "target", nowhere=tmp_path / "nowhere")
        assert not_a_file(path) == runtime_not_a_file(path) == want, name
    short = tempfile.mkdtemp(prefix="s")  # a socket's path must be short
    try:
        sock_path = os.path.join(short, "sock")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(sock_path)
            assert not_a_file(sock_path) == runtime_not_a_file(sock_path) == "a socket"
    finally:
        if os.path.exists(os.path.join(short, "sock")):
            os.unlink(os.path.join(short, "sock"))
        os.rmdir(short)


def test_atomic_writes_replace_only_regular_files(things):
    for name in ("fifo", "link", "dangling", "folder"):
        path = things[name]
        before = _snapshot(path)
        with pytest.raises(SpecError) as e:
            atomic_write_text(path, "x")
        assert str(e.value).startswith(f"{path}: error: is a ")
        assert "not a regular file: specc replaces only regular files, and left it as it is" in str(e.value)
        with pytest.raises(SpecError):
            atomic_write(path, lambda f: f.write(b"x"))
        assert _snapshot(path) == before
    assert sorted(os.listdir(os.path.dirname(things["file"]))) == \
        ["dangling", "fifo", "file", "folder", "link", "target"]  # no temporary left behind
    for name in ("absent", "file"):
        atomic_write_text(things[name], "new\n")
        assert open(things[name]).read() == "new\n"
    with pytest.raises(SpecError, match="the output path is empty"):
        check_replaceable("")


def _one_line(capsys, argv, starts: str) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(starts), err
    return err


def test_graph_output_that_is_not_a_regular_file(capsys, things, tmp_path):
    for name in ("fifo", "link", "dangling"):
        path = things[name]
        before = _snapshot(path)
        _one_line(capsys, ["graph", GPT_TINY, "-o", path], f"{path}: error: is a ")
        assert _snapshot(path) == before
    assert (tmp_path / "target").read_text() == "the link's target\n"
    assert not (tmp_path / "nowhere").exists()
    _one_line(capsys, ["graph", GPT_TINY, "-o", ""], "-o: error: the output path is empty")
    assert main(["graph", GPT_TINY, "-o", things["file"]]) == 0  # a regular file is replaced
    assert open(things["file"]).read().startswith("digraph")


def test_plot_output_that_is_not_a_regular_file(capsys, things, tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1, "loss": 3.0}\n'
                                       '{"kind": "train", "iteration": 2, "loss": 2.5}\n')
    for name in ("fifo", "link"):
        path = things[name]
        before = _snapshot(path)
        _one_line(capsys, ["plot", run, "-o", path], f"{path}: error: is a ")
        assert _snapshot(path) == before
    _one_line(capsys, ["plot", run, "-o", ""], "-o: error: the output path is empty")
    os.mkfifo(run / "loss.png")  # the default output
    _one_line(capsys, ["plot", run], f"{run / 'loss.png'}: error: is a FIFO (named pipe), not a regular file")
    assert stat.S_ISFIFO(os.lstat(run / "loss.png").st_mode)
    assert sorted(os.listdir(run)) == ["loss.png", "metrics.jsonl"]
