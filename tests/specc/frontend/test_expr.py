"""`${...}` interpolation: arithmetic, functions, config references, and located errors."""

from __future__ import annotations

import math
import sys

import pytest

from specc.errors import Loc, SpecError
from specc.frontend.expr import evaluate, interpolate

from .conftest import BASE, with_config

CONFIG = {"hidden_size": 768, "num_layers": 12, "heads": 12, "ratio": 2.5, "act": "gelu"}
AT = Loc("spec.yaml", 3, 10)


def lookup(name, loc):
    if name not in CONFIG:
        raise SpecError(loc, f"undefined '{name}'")
    return CONFIG[name]


@pytest.mark.parametrize("expr, value", [
    ("${4 * hidden_size}", 3072),
    ("${hidden_size // heads}", 64),
    ("${hidden_size / heads}", 64.0),
    ("${hidden_size % 100}", 68),
    ("${2 ** 10}", 1024),
    ("${hidden_size + 2 * 64 - 1}", 895),
    ("${(hidden_size + 1) * 2}", 1538),
    ("${-hidden_size}", -768),
    ("${min(hidden_size, 512, 1024)}", 512),
    ("${max(num_layers, 2)}", 12),
    ("${sqrt(2 * num_layers)}", math.sqrt(24)),
    ("${int(ratio * 4)}", 10),
    ("${ceil(hidden_size / 7)}", 110),
    ("${floor(hidden_size / 7)}", 109),
    ("${0.02 / sqrt(2 * num_layers)}", 0.02 / math.sqrt(24)),
    ("  ${ 4 * hidden_size }  ", 3072),  # one whole interpolation, with spaces
])
def test_arithmetic(expr, value):
    got = interpolate(expr, AT, lookup)
    assert got == pytest.approx(value) and type(got) is type(value)


def test_whole_interpolation_keeps_the_type_and_parts_format_into_a_string():
    assert interpolate("${act}", AT, lookup) == "gelu"
    assert interpolate("layer_${num_layers}_of_${hidden_size / 2}", AT, lookup) == "layer_12_of_384"
    assert interpolate("no interpolation", AT, lookup) == "no interpolation"


@pytest.mark.parametrize("expr, what, col", [
    ("${hidden_size // 0}", "division by zero in 'hidden_size // 0'", 12),
    ("${hidden_size % (num_layers - 12)}", "division by zero", 12),
    ("${hiden_size}", "undefined 'hiden_size'", 12),
    ("${4 * * hidden_size}", "bad expression '4 * * hidden_size'", 16),
    ("${2 ** 100}", "exponent 100 is too large (at most 64)", 12),
    ("${__import__('os')}", "unknown function '__import__'", 12),
    ("${hidden_size.real}", "unsupported expression 'hidden_size.real'", 12),
    ("${'abc'}", "unsupported expression", 12),
    ("${act * 2}", "'act' is not a number, but the string 'gelu'", 12),
    ("${sqrt(-1)}", "bad call sqrt(): math domain error", 12),
    ("${int(1e400)}", "bad call int(): cannot convert float infinity to integer", 12),
    ("${(-8) ** 0.5}", "the result is not a real number", 12),
    ("${10 ** 40}", "'10 ** 40' is too large", 12),
    ("${min()}", "bad call min()", 12),
    ("${}", "empty interpolation", 12),
    ("${hidden_size", "unterminated '${'", 10),
    ("${a${b}}", "nested braces", 13),
    ("x ${hidden_size} ${y", "unterminated '${'", 27),
])
def test_errors_are_located(expr, what, col):
    with pytest.raises(SpecError) as info:
        interpolate(expr, AT, lookup)
    e = info.value
    assert what in e.what
    assert (e.loc.path, e.loc.line, e.loc.col) == ("spec.yaml", 3, col)


def test_no_code_runs():
    """Expressions are walked, never eval'ed: attribute access, calls and lambdas are refused."""
    for source in ("().__class__", "open('x')", "(lambda: 1)()", "[x for x in ()]", "hidden_size if 1 else 2"):
        with pytest.raises(SpecError):
            evaluate(source, AT, lookup)


def test_deep_expressions_fail_cleanly():
    with pytest.raises(SpecError) as info:
        evaluate("1" + "+1" * 20000, AT, lookup)
    assert "nested too deeply" in info.value.what
    limit = sys.getrecursionlimit()
    assert sys.getrecursionlimit() == limit


def test_no_syntax_warning_reaches_stderr(capfd):
    with pytest.raises(SpecError):
        evaluate("1if hidden_size else 2", AT, lookup)
    assert capfd.readouterr().err == ""


def test_nested_config_references(load):
    spec = load(with_config(BASE, head_dim="${hidden_size // heads}", heads=4, kv="${2 * head_dim}",
                            ffn="${kv * 4 + head_dim}"))
    assert spec.config["head_dim"] == 16
    assert spec.config["kv"] == 32
    assert spec.config["ffn"] == 144


def test_builtin_names(load):
    spec = load(with_config(BASE, shards="${tensor_model_parallel_size * 2}", mbs="${micro_batch_size}"),
                tp=4, micro_batch_size=3)
    assert spec.config["shards"] == 8 and spec.config["mbs"] == 3
    assert spec.inputs[0].shape == (3, 8)


def test_undefined_name_suggests_the_closest(error):
    e = error(BASE.replace('embedding_dim: "${hidden_size}"', 'embedding_dim: "${hiden_size}"'))
    assert e.what == "undefined interpolation variable 'hiden_size'"
    assert e.hint == "did you mean 'hidden_size'?"


def test_config_cycle(error):
    e = error(with_config(BASE, a="${b + 1}", b="${c}", c="${a}"))
    assert e.what == "config values refer to each other in a cycle: a -> b -> c -> a"
    assert (e.loc.line, e.loc.col) == (3, 6)


def test_long_config_chains_are_bounded(error):
    chain = {f"v{i}": f"${{v{i + 1}}}" for i in range(100)}
    chain["v100"] = 1
    e = error(with_config(BASE, **chain))
    assert "more than 64 deep" in e.what and e.loc.line > 0
