"""Property: any mutation of a shipped spec either still compiles, or fails with a SpecError whose
message is one located line. Never another exception, whatever the text.

Mutations work on the text (truncate, insert or delete characters, swap or duplicate lines, rewrite
a `${...}`) and on the parsed YAML (delete, rename or retype a key, duplicate or swap list items,
change an op's name). Mutants are written next to copies of the specs they extend."""

from __future__ import annotations

import re
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specc.compiler import load_and_compile
from specc.errors import Loc, SpecError
from specc.frontend.model import Settings
from specc.ops import SPEC_OPS

ROOT = Path(__file__).resolve().parents[3]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
TEXTS = {p.name: p.read_text(encoding="utf-8") for p in SPECS}
PARSED = {name: yaml.safe_load(text) for name, text in TEXTS.items()}
LOCATED = re.compile(r"^[^\n]+:(\d+):(\d+): error: [^\n]+$")
UNLOCATED = re.compile(r"^[^\n]+: error: [^\n]+$")

# values a mutation may put anywhere: other types, edge numbers, names, expressions
SCALARS = st.one_of(
    st.integers(-3, 300), st.sampled_from([0, -1, 2 ** 62, 10 ** 40, 7]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=12), st.sampled_from(["${hidden_size}", "${hidden_size / 3}", "${nope}", "${", "gelu", "column",
                                           "torch", "self", "x", "return x", "${1 // 0}", "${2 ** 99}", "MLP"]),
    st.lists(st.integers(-2, 64), max_size=3), st.dictionaries(st.sampled_from(["op", "module", "a"]), st.integers(0, 9),
                                                               max_size=2),
)
INSERTS = st.text(alphabet=st.sampled_from(list(":-[]{}&*!|>'\"#%@`,?$\t\n ${}()+=/\\x0aZ\u00e9\u2028")), min_size=1,
                  max_size=8)


@pytest.fixture(scope="module")
def workdir():
    """Copies of every shipped spec, so a mutant's `extends:` finds its parent beside it."""
    with tempfile.TemporaryDirectory(prefix="specc-fuzz-") as d:
        for p in SPECS:
            shutil.copy(p, d)
        yield Path(d)


# -- mutations --------------------------------------------------------------------------------

def _paths(node, prefix=()):
    """Every (path, value) in a parsed document."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _structural(data, doc):
    """Mutate a parsed document in place (a fresh copy) and return it."""
    paths = [p for p, _ in _paths(doc) if p]
    kind = data.draw(st.sampled_from(["delete", "retype", "rename", "duplicate", "swap", "op", "expr"]), label="kind")
    if kind == "op":
        ops = [p for p in paths if p[-1] == "op"]
        path = data.draw(st.sampled_from(ops or paths), label="path")
        value = data.draw(st.sampled_from(sorted(SPEC_OPS) + ["nope", "Linear", "module"]), label="op")
    elif kind == "expr":
        exprs = [p for p in paths if isinstance(_get(doc, p), str) and "${" in _get(doc, p)]
        path = data.draw(st.sampled_from(exprs or paths), label="path")
        value = "${" + data.draw(st.sampled_from([
            "hidden_size * 3", "hidden_size // 0", "hidden_size / 7", "2 ** 70", "min(hidden_size)", "sqrt(-1)",
            "num_layers - 100", "hidden_size +", "undefined_name", "max(1, 2.5)", "ceil(hidden_size / 5)",
            "-hidden_size", "hidden_size % 3", "1e400", "int(1e400)", "seq_length * 2", "tensor_model_parallel_size"]),
            label="expr") + "}"
    else:
        path = data.draw(st.sampled_from(paths), label="path")
        value = None
    parent, key = _get(doc, path[:-1]), path[-1]
    if kind == "delete":
        del parent[key]
    elif kind in ("retype", "op", "expr"):
        parent[key] = data.draw(SCALARS, label="value") if kind == "retype" else value
    elif kind == "rename" and isinstance(parent, dict):
        new = data.draw(st.one_of(st.sampled_from(["module", "op", "inputs", "forward", "submodule", "repeat", "class",
                                                   "self", "2x", "hidden_size", "extends", "name", "segments"]),
                                  st.text(max_size=8)), label="new key")
        parent[new] = parent.pop(key)
    elif kind == "duplicate" and isinstance(parent, list):
        parent.insert(key, parent[key])
    elif kind == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = data.draw(st.integers(0, len(parent) - 1), label="other")
        parent[key], parent[other] = parent[other], parent[key]
    return doc


def _textual(data, text: str) -> str:
    kind = data.draw(st.sampled_from(["truncate", "insert", "delete", "swap_lines", "dup_line", "interp"]), label="kind")
    n = len(text)
    if kind == "truncate":
        return text[: data.draw(st.integers(0, n), label="at")]
    if kind == "insert":
        at = data.draw(st.integers(0, n), label="at")
        return text[:at] + data.draw(INSERTS, label="chars") + text[at:]
    if kind == "delete":
        at = data.draw(st.integers(0, n), label="at")
        return text[:at] + text[at + data.draw(st.integers(1, 20), label="length"):]
    if kind == "interp":
        spans = [m.span(1) for m in re.finditer(r"\$\{([^}]*)\}", text)]
        if not spans:
            return text
        a, b = data.draw(st.sampled_from(spans), label="span")
        new = data.draw(st.one_of(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789+-*/%() ,.{}$", max_size=16),
                                  st.sampled_from(["hidden_size //", "4 ** 99", "x.y", "__import__('os')", "'a'",
                                                   "hidden_size if 1 else 2", "1if 2 else 3", "lambda: 1", "[1, 2]", "", " "])),
                        label="expr")
        return text[:a] + new + text[b:]
    lines = text.split("\n")
    i = data.draw(st.integers(0, len(lines) - 1), label="line")
    if kind == "dup_line":
        lines.insert(i, lines[i])
    else:
        j = data.draw(st.integers(0, len(lines) - 1), label="other line")
        lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


# -- the property -------------------------------------------------------------------------------

def check_outcome(path: Path, text: str, tp: int, sp: bool, overrides=()) -> str:
    """Compile; return 'ok' or the error line, failing on anything but a well-formed SpecError
    (or on a warning, which would print a second line on stderr)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load_and_compile(str(path), Settings(tp=tp, sp=sp), overrides=list(overrides))
        except SpecError as e:
            error = e
        else:
            error = None
    assert not caught, [str(w.message) for w in caught]
    if error is not None:
        line = error.format()
        assert len(line.splitlines()) == 1 and line.isprintable(), f"not one printable line: {line!r}"
        m = LOCATED.match(line)
        assert m or UNLOCATED.match(line), f"not a located error: {line!r}"
        if m and line.startswith(f"{path}:"):
            lineno, col = int(m.group(1)), int(m.group(2))
            assert 1 <= lineno <= text.count("\n") + 2 and col >= 1, f"location outside the file: {line!r}"
        return line
    return "ok"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_specs_fail_cleanly(workdir, data):
    name = data.draw(st.sampled_from(sorted(TEXTS)), label="spec")
    if data.draw(st.booleans(), label="textual"):
        text = _textual(data, TEXTS[name])
    else:
        import copy

        doc = _structural(data, copy.deepcopy(PARSED[name]))
        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=data.draw(st.booleans(), label="unicode"))
    path = workdir / "mutant.yaml"
    path.write_text(text, encoding="utf-8")
    tp = data.draw(st.sampled_from([1, 2, 4]), label="tp")
    sp = data.draw(st.booleans(), label="sp")
    overrides = []
    if data.draw(st.integers(0, 4), label="override?") == 0:
        key = data.draw(st.sampled_from(["hidden_size", "num_layers", "seq_length", "hiden_size", "modules.MLP.forward",
                                         "modules.MLP.submodules.linear_fc1.bias", "config.vocab_size", "a.b"]))
        value = data.draw(st.one_of(st.integers(-2, 300), st.text(max_size=6), st.booleans(), st.floats()))
        overrides.append((key, value, Loc(f"--set {key}={value}")))
    check_outcome(path, text, tp, sp, overrides)


def test_every_parent_is_valid(workdir):
    """The unmutated specs compile, so mutants start from valid text."""
    for name, text in TEXTS.items():
        assert check_outcome(workdir / name, text, 2, True) == "ok"
