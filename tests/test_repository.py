"""The repository keeps what its documents promise: CI runs the README's test command, and that
command lints and checks generated/ before the suite; every document a source file names exists;
verify's docstring names the optimizer its code uses."""

from __future__ import annotations

import ast
import os
import re
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_ci_runs_the_readme_test_command_which_lints_and_checks_generated_first():
    assert "    make test " in _read("README.md")
    assert "make test" in [line.strip() for line in _read(".ci", "run").splitlines()]
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()

    def where(pattern: str) -> int:
        hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert hits, f"`make test` does not run {pattern!r}:\n{dry.stdout}"
        return hits[0]

    lint = where(r"ruff check specc runtime specc_torch specc_cli tests\b")
    check = where(r"-m specc_cli check generated\b")
    suite = where(r"-m pytest\b")
    assert lint < suite and check < suite  # fast failures first


def _named_documents():
    """(file, line number, name) of every Markdown document the sources and docs name."""
    tops = ["specc", "runtime", "specc_torch", "bench", "docs"]
    files = ["README.md", "compile.py"]
    for top in tops:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            # hidden folders are environments (bench/.megatron), not the repository's documents
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            files += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in sorted(filenames)
                      if f.endswith((".py", ".md", ".j2"))]
    for rel in files:
        for number, line in enumerate(_read(rel).splitlines(), start=1):
            for name in re.findall(r"[A-Za-z0-9_./-]*[A-Za-z0-9_]\.md\b", line):
                yield rel, number, name


def test_every_document_a_source_names_exists():
    missing = []
    for rel, number, name in _named_documents():
        here = os.path.dirname(os.path.join(ROOT, rel))
        if not any(os.path.isfile(os.path.join(base, name)) for base in (here, ROOT, os.path.join(ROOT, "docs"))):
            missing.append(f"{rel}:{number}: {name}")
    assert not missing, "documents named but not in the repository:\n" + "\n".join(missing)


def test_verify_docstring_names_the_optimizer_its_code_uses():
    source = _read("specc_torch", "verify.py")
    doc = ast.get_docstring(ast.parse(source))
    used = set(re.findall(r"torch\.optim\.(\w+)\(", source))
    if re.search(r"\.add_\(\w+\.grad, alpha=-cfg\.lr\)", source):
        used.add("SGD")  # torch.optim.SGD's step (no momentum) written out: p -= lr * grad
    assert used, "verify no longer builds a torch optimizer nor steps SGD by hand: update this test"
    for name in used:
        assert re.search(rf"\b{name}\b", doc), f"verify's docstring does not name {name}, the optimizer it uses"
    for other in {"Adam", "AdamW", "SGD"} - used:
        assert not re.search(rf"\b{other}\b", doc), f"verify's docstring names {other}; the code uses {sorted(used)}"
