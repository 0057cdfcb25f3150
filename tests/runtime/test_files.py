"""The runtime's writers replace only regular files (runtime/files.py): the run directory's
config.json and metrics.jsonl, a save directory's `latest`, `data prepare`'s PREFIX.bin/.idx. A
FIFO, a symbolic link (even to a regular file) or a folder at the path is refused with one line
naming it and what it is, and is left exactly as it was; a FIFO never blocks a writer or a reader.

Every FIFO here has a reader (or a writer) held open by the test, so that a writer that does open
it (the defect these tests catch) fails the test instead of blocking it."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import threading

import pytest

from runtime.files import NotARegularFile, check_replaceable, open_to_write, replace, write_atomically


@contextlib.contextmanager
def fifo_with_reader(path):
    """A FIFO at `path`, a non-blocking reader held open on it; yields a function that returns what
    was written into it (b'' when nothing was)."""
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def written() -> bytes:
        try:
            return os.read(fd, 1 << 16)
        except BlockingIOError:
            return b""

    try:
        yield written
    finally:
        os.close(fd)


def read_beside_a_writer(fifo: str, data: bytes, read, wait: float = 10.0):
    """read() in a thread while a writer holds `fifo` open with `data` in it; the writer is closed
    after `wait` seconds (a reader blocked on the FIFO then sees its end). Returns what read()
    returned or raised."""
    out = []
    fd = os.open(fifo, os.O_RDWR)  # a writer that never blocks, and keeps a reader's open() from blocking
    try:
        os.write(fd, data)

        def run():
            try:
                out.append(read())
            except BaseException as e:  # noqa: BLE001 - handed to the test
                out.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(wait)
    finally:
        os.close(fd)
    thread.join()
    return out[0]


def _link(tmp_path, name):
    target = tmp_path / f"{name}.target"
    target.write_text("the user's file\n")
    os.symlink(str(target), str(tmp_path / name))
    return str(tmp_path / name), target


def _is_fifo(path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def test_the_helpers_refuse_all_but_regular_files(tmp_path):
    link, target = _link(tmp_path, "link")
    (tmp_path / "folder").mkdir()
    with fifo_with_reader(str(tmp_path / "fifo")) as written:
        for path, what in [(str(tmp_path / "fifo"), "a FIFO (named pipe)"), (link, f"a symbolic link (to {target})"),
                           (str(tmp_path / "folder"), "a folder")]:
            message = f"{path} is {what}, not a regular file: only regular files are replaced, and it is left as it is"
            for write in (lambda p: open_to_write(p, "w"), lambda p: open_to_write(p, "ab"),
                          lambda p: write_atomically(p, "x"), check_replaceable):
                with pytest.raises(NotARegularFile) as e:
                    write(path)
                assert str(e.value) == message
            src = tmp_path / "src"
            src.write_text("new")
            with pytest.raises(NotARegularFile):
                replace(str(src), path)
            assert src.read_text() == "new"
        assert written() == b"" and _is_fifo(tmp_path / "fifo")
    assert target.read_text() == "the user's file\n" and os.path.islink(link)
    with pytest.raises(NotARegularFile, match="^the output path is empty$"):
        check_replaceable("")
    with open_to_write(str(tmp_path / "new.txt")) as f:  # nothing there, or a regular file: written
        f.write("one\n")
    with open_to_write(str(tmp_path / "new.txt"), "a") as f:
        f.write("two\n")
    assert (tmp_path / "new.txt").read_text() == "one\ntwo\n"
    write_atomically(str(tmp_path / "new.txt"), b"three\n", durable=True)
    assert (tmp_path / "new.txt").read_text() == "three\n"
    assert sorted(os.listdir(tmp_path)) == ["fifo", "folder", "link", "link.target", "new.txt", "src"]


def test_the_run_directory_files_are_regular_files_or_nothing(tmp_path):
    from runtime.train.report import CONFIG, METRICS, Reporter

    quiet = {"progress": False, "stream": io.StringIO()}
    run = tmp_path / "run"
    run.mkdir()
    with fifo_with_reader(str(run / METRICS)) as written:
        for append in (False, True):
            with pytest.raises(NotARegularFile, match=f"^{run / METRICS} is a FIFO \\(named pipe\\), not a regular"):
                Reporter(str(run), 4, 2, append=append, **quiet)
        assert written() == b"" and _is_fifo(run / METRICS)
    os.unlink(run / METRICS)
    link, target = _link(run, CONFIG)
    rep = Reporter(str(run), 4, 2, **quiet)
    with pytest.raises(NotARegularFile, match=f"^{link} is a symbolic link"):
        rep.start({"lr": 1.0}, {"vocab_size": 8})
    rep.close()
    assert target.read_text() == "the user's file\n" and os.path.islink(link)


def test_a_save_directory_latest_that_is_not_a_regular_file(tmp_path):
    from runtime.checkpoint import CheckpointError, latest_step
    from runtime.checkpoint.on_disk import LATEST, _publish

    save = tmp_path / "save"
    save.mkdir()
    # a FIFO `latest`: reading it blocked forever. The read runs in a thread beside a writer held
    # open with a step in it; the writer is closed after 10 s, so that a reader that did open the
    # FIFO sees the end of it and returns (and the test fails) instead of blocking.
    os.mkfifo(save / LATEST)
    outcome = read_beside_a_writer(str(save / LATEST), b"5\n", lambda: latest_step(str(save)))
    assert isinstance(outcome, CheckpointError), f"read the FIFO: {outcome!r}"
    assert str(outcome) == f"{save / LATEST}: is a FIFO (named pipe), not the file naming the latest step"
    assert stat.S_ISFIFO(os.lstat(save / LATEST).st_mode)
    os.unlink(save / LATEST)
    # a `latest` that is a link: publishing a step would replace the link (a save refuses it first)
    link, target = _link(save, LATEST)
    tmp = save / "step_0000001.tmp-abcd"
    tmp.mkdir()
    with pytest.raises(NotARegularFile, match=f"^{link} is a symbolic link"):
        _publish(str(save), "step_0000001", str(tmp), 1, "abcd")
    assert target.read_text() == "the user's file\n" and os.path.islink(link)
    assert sorted(os.listdir(save)) == [LATEST, "latest.target", "step_0000001.tmp-abcd"]  # nothing moved


def test_prepare_names_what_is_at_its_outputs(tmp_path):
    from runtime.data import DataError, prepare

    src = tmp_path / "in.txt"
    src.write_text("abc")
    out = tmp_path / "out"
    with fifo_with_reader(str(tmp_path / "out.bin")) as written:
        with pytest.raises(DataError) as e:
            prepare([str(src)], "byte", str(out))
        assert str(e.value) == (f"--output-prefix {out}: {out}.bin is a FIFO (named pipe), not a regular file: only "
                                "regular files are replaced, and it is left as it is (move it away or choose another "
                                "--output-prefix)")
        assert written() == b"" and _is_fifo(tmp_path / "out.bin")
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out.bin"]
