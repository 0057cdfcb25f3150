"""`specc compile -o D` replaces only what it wrote itself: a folder holding its marker and
nothing but its own files. A user's folder or file of the same name is refused with one line and
left exactly as it was; so is a generated folder someone put a file of their own into. Compiles
running at the same time into one folder all succeed, and the folder is never missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from specc.emit.write import FILES, MARKER, MARKER_TEXT
from specc_cli.main import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
OUTPUT = sorted(FILES + ("__init__.py", MARKER))


def _args(tmp_path, *flags) -> list:
    return ["compile", TINY, "-o", str(tmp_path), "--name", "out", *flags]


def _compile(tmp_path, *flags):
    return main(_args(tmp_path, *flags))


def _tree(path) -> dict:
    """Every file under `path` (hidden ones too) with its bytes."""
    found = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            found[os.path.relpath(full, path)] = open(full, "rb").read()
    return found


def _refused(capsys, argv) -> str:
    """Run `specc ARGV`, which must refuse: exit 2 and one error line, no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_user_folder_or_file_of_that_name_is_refused_and_untouched(tmp_path, capsys):
    user = tmp_path / "out"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("mine\n")
    (user / "sub" / "data.csv").write_text("1,2\n")
    before = _tree(tmp_path)
    line = _refused(capsys, _args(tmp_path))
    assert line.startswith(f"error: {user} is a folder that specc compile did not write (it has no {MARKER})")
    assert "--name or -o" in line
    assert _tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["out"]  # nothing renamed or left

    # a user's file of that name: refused, not renamed into a hidden .out.old-*
    (user / "sub" / "data.csv").unlink()
    (user / "sub").rmdir()
    (user / "notes.txt").unlink()
    user.rmdir()
    user.write_text("my file\n")
    assert _refused(capsys, _args(tmp_path)).startswith(f"error: {user} exists and is not a folder that specc compile wrote")
    assert sorted(os.listdir(tmp_path)) == ["out"] and user.read_text() == "my file\n"

    # a symbolic link to a folder: refused too (replacing it would not replace what it points at)
    user.unlink()
    (tmp_path / "elsewhere").mkdir()
    user.symlink_to(tmp_path / "elsewhere")
    assert "exists and is not a folder that specc compile wrote" in _refused(capsys, _args(tmp_path))
    assert os.path.islink(user)


def test_a_generated_folder_is_replaced_but_not_with_a_user_file_inside(tmp_path, capsys):
    assert _compile(tmp_path) == 0
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == OUTPUT and (out / MARKER).read_text() == MARKER_TEXT
    (out / "__pycache__").mkdir()  # importing the module leaves this: still only specc's
    (out / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (out / "plan.txt").write_text("old plan\n")
    assert _compile(tmp_path, "--tp", "2") == 0
    assert sorted(os.listdir(out)) == OUTPUT and "tp=2" in (out / "plan.txt").read_text()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary, no old copy left

    (out / "my_notes.md").write_text("keep me\n")
    before = _tree(tmp_path)
    assert _refused(capsys, _args(tmp_path)) == (f"error: {out} holds my_notes.md, which specc compile did not write "
                                       "(move it out of the folder first: compiling replaces the whole folder)")
    assert _tree(tmp_path) == before

    # the marker's content matters, not only its name
    (out / "my_notes.md").unlink()
    (out / MARKER).write_text("something else\n")
    assert "did not write (it has no .specc-output)" in _refused(capsys, _args(tmp_path))


def test_folders_from_before_the_marker_and_empty_folders_are_replaced(tmp_path, capsys):
    assert _compile(tmp_path) == 0
    out = tmp_path / "out"
    (out / MARKER).unlink()  # what an older specc wrote: only its files, a generated model.py
    assert _compile(tmp_path, "--tp", "2") == 0
    assert sorted(os.listdir(out)) == OUTPUT

    (out / MARKER).unlink()
    (out / "model.py").write_text('"""a model of my own"""\nCOMPILE_COMMAND = "specc compile x"\n')
    # no marker and not a generated model.py: the user's
    assert "did not write" in _refused(capsys, _args(tmp_path))
    assert (out / "model.py").read_text().startswith('"""a model of my own"""')

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["compile", TINY, "-o", str(tmp_path), "--name", "empty"]) == 0
    assert sorted(os.listdir(empty)) == OUTPUT


def test_an_output_root_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "root").write_text("x\n")
    assert _refused(capsys, ["compile", TINY, "-o", str(tmp_path / "root")]).startswith(f"error: cannot write {tmp_path / 'root'}")
    assert (tmp_path / "root").read_text() == "x\n"


def test_the_committed_generated_folders_carry_the_marker():
    folders = [n for n in sorted(os.listdir(os.path.join(ROOT, "generated"))) if not n.startswith(".")]
    assert folders
    for name in folders:
        with open(os.path.join(ROOT, "generated", name, MARKER)) as f:
            assert f.read() == MARKER_TEXT, name


# -- many compiles at once ---------------------------------------------------------------------------

WRITER = textwrap.dedent("""
    import os, sys, time
    from specc.emit import write

    root, go, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if sys.argv[4] == "rename":
        import specc.files
        specc.files._exchange = lambda a, b: False  # the portable path: rename away, then in
    files = {name: name * 2000 for name in write.FILES}
    write.render_all = lambda spec, graph, command, recipe=None: files  # the swap is under test, not the compiler
    while not os.path.exists(go):
        time.sleep(0.001)
    failures = 0
    for _ in range(n):
        try:
            write.compile_to_dir(None, None, root, "specc compile x", "out")
        except Exception as e:
            failures += 1
            print(repr(e), file=sys.stderr)
    print(failures)
""")

READER = textwrap.dedent("""
    import os, sys, time
    target, go, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    while not os.path.exists(go):
        time.sleep(0.001)
    looks, missing = 0, 0
    while not os.path.exists(stop):
        looks += 1
        missing += not os.path.isfile(os.path.join(target, "model.py"))
    print(looks, missing)
""")


@pytest.mark.parametrize("swap", ["exchange", "rename"])
def test_concurrent_compiles_into_one_folder_all_succeed(tmp_path, swap):
    if swap == "exchange" and not sys.platform.startswith("linux"):
        pytest.skip("the atomic exchange is Linux's renameat2")
    root, go, stop = tmp_path / "gen", tmp_path / "go", tmp_path / "stop"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # a first compile, so that every later one replaces a folder
    subprocess.run([sys.executable, "-c", WRITER, str(root), str(root), "1", swap], env=env, check=True,
                   capture_output=True)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(go), "100", swap], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    reader = subprocess.Popen([sys.executable, "-c", READER, str(root / "out"), str(go), str(stop)],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # every process imported and waiting
    go.write_text("")
    results = [w.communicate(timeout=120) for w in writers]
    stop.write_text("")
    looks, missing = map(int, reader.communicate(timeout=60)[0].split())
    for (out, err), w in zip(results, writers):
        assert w.returncode == 0 and out.strip() == "0", err[-2000:]  # 400 compiles, none failed
    assert sorted(os.listdir(root)) == ["out"]  # no temporary or old folder left
    assert sorted(os.listdir(root / "out")) == OUTPUT
    for name in FILES:
        assert (root / "out" / name).read_text() == name * 2000
    assert looks > 0
    if swap == "exchange":
        assert missing == 0  # the folder never disappeared, not even between two renames
