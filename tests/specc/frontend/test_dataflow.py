"""Forward steps: parsing into Expr trees with columns, and the dataflow checks of a module."""

from __future__ import annotations

import pytest

from specc.errors import Loc, SpecError
from specc.frontend.dataflow import check_identifier, parse_step

from .conftest import BASE

AT = Loc("spec.yaml", 7, 9)


def shape(e):
    """An Expr as nested tuples, for comparing trees."""
    if e.kind == "var":
        return e.name
    if e.kind == "call":
        return (e.name, *[shape(a) for a in e.args])
    return (e.kind, *[shape(a) for a in e.args])


def test_sum_of_three_is_one_nary_add():
    step = parse_step("y = a + b + c", AT)
    assert step.targets == ["y"]
    assert shape(step.expr) == ("add", "a", "b", "c")


def test_sums_flatten_through_parentheses_but_products_do_not():
    assert shape(parse_step("y = a + (b + c) + d", AT).expr) == ("add", "a", "b", "c", "d")
    assert shape(parse_step("y = a * b * c", AT).expr) == ("mul", ("mul", "a", "b"), "c")
    assert shape(parse_step("y = a * b + c", AT).expr) == ("add", ("mul", "a", "b"), "c")


def test_nested_calls():
    step = parse_step("x = x + dropout(attention(norm(x)))", AT)
    assert shape(step.expr) == ("add", "x", ("dropout", ("attention", ("norm", "x"))))
    step = parse_step("out = f(g(a), h(b, c))", AT)
    assert shape(step.expr) == ("f", ("g", "a"), ("h", "b", "c"))


def test_tuple_unpacking():
    step = parse_step("q, k, v = split(qkv)", AT)
    assert step.targets == ["q", "k", "v"]
    assert shape(step.expr) == ("split", "qkv")


def test_return_of_several_names():
    step = parse_step("return loss, logits", AT)
    assert step.expr is None and step.returns == ["loss", "logits"]
    assert parse_step("return(y)", AT).returns == ["y"]
    assert parse_step("returned = f(x)", AT).targets == ["returned"]  # a name that starts with 'return'


def test_columns_of_names_and_calls():
    step = parse_step("h = h + mlp(norm(h))", AT)
    add = step.expr
    assert add.loc.col == 9 + 4
    assert [a.loc.col for a in add.args] == [9 + 4, 9 + 8]
    assert add.args[1].args[0].loc.col == 9 + 12
    assert add.args[1].args[0].args[0].loc.col == 9 + 17


@pytest.mark.parametrize("text, what, offset", [
    ("y = f(x", "bad step 'y = f(x': '(' was never closed", 5),
    ("y = x.weight", "unsupported expression 'x.weight' in a forward step", 4),
    ("y = a - b", "unsupported expression 'a - b' in a forward step", 4),
    ("y = f(x=1)", "keyword arguments are not supported in forward steps", 6),
    ("y = f(*xs)", "starred arguments are not supported", 6),
    ("y = mods[0](x)", "only submodules can be called, by their plain name", 4),
    ("y[0] = f(x)", "only plain names can be assigned", 0),
    ("y = z = f(x)", "bad step 'y = z = f(x)'", 0),
    ("f(x)", "bad step 'f(x)'", 0),
    ("a, a = f(x)", "a name is assigned twice in 'a, a = f(x)'", 0),
    ("lambda = f(x)", "'lambda' is a Python keyword and cannot name a variable", 0),
    ("y = f(class)", "'class' is a Python keyword and cannot name a variable", 6),
    ("match = f(x)", "variable 'match' is a Python keyword", 0),
    ("torch = f(x)", "variable 'torch' is reserved in generated code", 0),
    ("y, self = f(x)", "variable 'self' is reserved in generated code", 3),
    ("return", "return needs a value", 6),
    ("return f(x)", "return takes variable names only", 7),
    ("return a, f(x)", "return takes variable names only", 10),
])
def test_bad_steps_are_located(text, what, offset):
    with pytest.raises(SpecError) as info:
        parse_step(text, AT)
    assert what in info.value.what
    assert info.value.loc == Loc("spec.yaml", 7, 9 + offset)


def test_a_step_must_be_a_string():
    with pytest.raises(SpecError) as info:
        parse_step({"y": "f(x)"}, AT)
    assert info.value.what == "a forward step must be a string like 'y = f(x)', got a mapping"
    assert "quote" in info.value.hint


@pytest.mark.parametrize("name, what", [
    ("2x", "is not a valid Python identifier"), ("a-b", "is not a valid Python identifier"),
    ("é", "is not a valid Python identifier"), ("", "is not a valid Python identifier"),
    (3, "3 is not a valid Python identifier"), ("for", "is a Python keyword"), ("runtime", "is reserved"),
])
def test_identifiers(name, what):
    with pytest.raises(SpecError) as info:
        check_identifier(name, AT, "input")
    assert what in info.value.what


# -- module dataflow, through the loader --

def test_modules_get_inputs_steps_and_returns(load):
    spec = load(BASE)
    mlp = spec.modules["MLP"]
    assert mlp.inputs == ["x"] and mlp.returns == ["y"]
    assert [s.targets for s in mlp.steps] == [["h"], ["h"], ["y"], []]
    assert list(mlp.submodules) == ["fc1", "act", "fc2"]
    assert spec.root == "Model"


@pytest.mark.parametrize("old, new, what", [
    ("      - h = act(h)\n", "      - h = act(g)\n", "undefined variable 'g'"),
    ("      - h = act(h)\n", "      - h = relu(h)\n", "'relu' is not a submodule of MLP"),
    ("      - y = fc2(h)\n", "      - y = fc2(h, x)\n", "'fc2' takes 1 input(s), got 2"),
    ("      - h = act(h)\n", "      - h, g = act(h)\n", "'act' returns 1 value(s), but 2 name(s) receive them"),
    ("      - y = fc2(h)\n", "      - y = fc2(h)\n      - return y\n      - y = h\n", "step after 'return' is never run"),
    ("      - return y\n", "", "module 'MLP' does not end with a 'return' step"),
    ("      - return y\n", "      - return z\n", "return of undefined variable 'z'"),
    ("      act: {op: gelu}\n", "      act: {op: gelu}\n      extra: {op: silu}\n", "submodule 'extra' is never called"),
    ("      - y = fc2(h)\n", "      - y = fc2(h)\n      - a, b = y\n", "cannot unpack one value into 2 names"),
])
def test_dataflow_errors(error, old, new, what):
    assert old in BASE
    e = error(BASE.replace(old, new, 1))
    assert what in e.what and e.loc.line > 0


def test_a_variable_may_be_reassigned_and_returned_twice(load):
    spec = load(BASE.replace("      - y = fc2(h)\n      - return y\n", "      - y = fc2(h)\n      - return y, h\n")
                .replace("      - h = block(h)\n", "      - h, g = block(h)\n"))
    assert spec.modules["MLP"].returns == ["y", "h"]
