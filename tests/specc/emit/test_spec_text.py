"""Spec text reaches model.py only as a string literal or a docstring that no input can end early,
and spec names that would replace what nn.Module or the generated module defines are refused.

The property tests draw arbitrary unicode (quotes, backslashes, line breaks, NULs, surrogates) for
every free-text field a spec carries, and check that the generated file parses to exactly the
statements of a compile of the same spec with plain text, and that every text round-trips."""

from __future__ import annotations

import ast
import os
import re
import shlex
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specc.compiler import load_and_compile
from specc.emit import emit_model
from specc.emit.pytext import docstring_text, string_literal
from specc.errors import SpecError
from specc.frontend.dataflow import MODULE_GLOBALS, NN_MODULE_ATTRS, RESERVED
from specc.frontend.model import Settings
from specc_cli.main import main

# every free-text field a spec can carry; @NAME@ is replaced by a YAML double-quoted string
SPEC = """\
name: textprobe
description: @TOP@
config:
  hidden_size: 16
  vocab_size: 32
model:
  module: Model
  inputs:
    tokens: {shape: [1, 8], dtype: int64}
    labels: {shape: [1, 8], dtype: int64}
modules:
  Model:
    description: @MODEL@
    inputs: [tokens, labels]
    submodules:
      embedding: {op: embedding, num_embeddings: "${vocab_size}", embedding_dim: "${hidden_size}", description: @LEAF@}
      block: {module: MLP, description: @REF@}
      norm: {op: layernorm, hidden_size: "${hidden_size}"}
      output_layer: {op: linear, parallel: column, in_features: "${hidden_size}", out_features: "${vocab_size}"}
      loss: {op: cross_entropy}
    forward:
      - h = embedding(tokens)
      - h = h + block(norm(h))
      - logits = output_layer(h)
      - per_token_loss = loss(logits, labels)
      - return per_token_loss
  MLP:
    description: @MLP@
    inputs: [x]
    submodules:
      fc1: {op: linear, parallel: column, in_features: "${hidden_size}", out_features: "${4 * hidden_size}"}
      act: {op: gelu}
      fc2: {op: linear, parallel: row, in_features: "${4 * hidden_size}", out_features: "${hidden_size}"}
    forward:
      - h = fc1(x)
      - h = act(h)
      - y = fc2(h)
      - return y
hf:
  architecture: @HF@
"""
FIELDS = ("TOP", "MODEL", "LEAF", "REF", "MLP", "HF")
SETTINGS = (Settings(tp=1), Settings(tp=2, sp=True))
NASTY = ['"', '"""', "'''", "\\", "\\N{", "\n", "\r", "\r\n", "\t", "\x00", "\x0c", "\x85", "\u2028", "\u202e",
         "\ufeff", "\udc80", "\ud800", "\U0001f600", "é", "#", "{{", "}}", "{%", "${x}", "'", "`",
         "\nimport os\nos.system('x')\n", '"""\nraise SystemExit\n"""']
TEXT = st.lists(st.one_of(st.characters(exclude_categories=()), st.sampled_from(NASTY)), max_size=12).map("".join)


def yaml_quoted(text: str) -> str:
    """`text` as a YAML double-quoted scalar of printable ASCII (YAML's escapes for the rest)."""
    out = []
    for c in text:
        o = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif 0x20 <= o < 0x7F:
            out.append(c)
        else:
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


def spec_text(texts: dict) -> str:
    text = SPEC
    for field in FIELDS:
        text = text.replace(f"@{field}@", yaml_quoted(texts[field]))
    return text


def compile_spec(folder: str, text: str, setting: Settings, file_name: str = "probe.yaml"):
    path = os.path.join(folder, "probe.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    spec, graph = load_and_compile(path, setting, [])
    spec.path = os.path.join(folder, file_name)  # the file name goes into the header; any text at all
    return spec, graph


def skeleton(source: str) -> str:
    """The AST of a generated module with its docstrings and text constants blanked."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body and _docstring(body[0]) is not None:
            body[0].value.value = "<doc>"
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("SPEC_SHA256", "COMPILE_COMMAND"):
            node.value.value = "<text>"
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SETTINGS":
            ast.literal_eval(node.value)  # plain data, whatever the spec path holds
            for key, value in zip(node.value.keys, node.value.values):
                if key.value == "spec":
                    value.value = "<text>"
    return ast.dump(tree)


def constants(source: str) -> dict:
    """The module-level string constants of a generated module: SPEC_NAME, COMPILE_COMMAND, ..."""
    return {n.targets[0].id: n.value.value for n in ast.parse(source).body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)}


def _docstring(stmt):
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
        return stmt.value.value
    return None


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as d:
        yield d


@pytest.fixture(scope="module")
def baselines(folder):
    plain = {f: f"plain {f.lower()} text" for f in FIELDS}
    out = {}
    for setting in SETTINGS:
        _, graph = compile_spec(folder, spec_text(plain), setting)
        out[setting] = skeleton(emit_model(graph, "specc compile probe.yaml"))
    return out


def check_generated(source: str, texts: dict, file_name: str, command: str, baseline: str) -> None:
    assert source.isascii() and "\x00" not in source and "\r" not in source
    assert skeleton(source) == baseline  # the template's statements, nothing more, nothing less
    tree = ast.parse(source)
    top = texts["TOP"] or "textprobe"
    doc = ast.get_docstring(tree, clean=False)
    assert doc.startswith(f"textprobe: {top}\n\nGenerated by specc ")
    assert f" from {os.path.basename(file_name)} (spec sha256 " in doc
    assert f"recompile with `{command}`." in doc
    values = constants(source)
    assert values["SPEC_NAME"] == "textprobe" and values["COMPILE_COMMAND"] == command
    classes = {n.name: ast.get_docstring(n, clean=False) for n in tree.body if isinstance(n, ast.ClassDef)}
    assert sorted(classes) == ["MLP", "Model"]
    for name, field in (("Model", "MODEL"), ("MLP", "MLP")):
        want = texts[field] or f"The spec module {name}."
        assert classes[name].split() == want.split()  # wrapped at spaces, every character kept


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.fixed_dictionaries({f: TEXT for f in FIELDS}), file_name=TEXT.filter(lambda s: "/" not in s),
       command=TEXT)
def test_any_text_in_any_field_reaches_model_py_only_as_a_literal(folder, baselines, texts, file_name, command):
    for setting in SETTINGS:
        _, graph = compile_spec(folder, spec_text(texts), setting, file_name)
        check_generated(emit_model(graph, command), texts, file_name, command, baselines[setting])


# the cases the issue names, through `specc compile`: before, each produced a file that ran the
# injected statements or did not parse
INJECTED = ['x"""\nimport os; os.system("echo injected")\n"""', "ends in a backslash\\", 'ends in a quote"',
            "holds a \x00 NUL", '"""', 'a\r\nb\u2028c\udcffd']


@pytest.mark.parametrize("field", ["TOP", "MODEL", "MLP"])
@pytest.mark.parametrize("text", INJECTED, ids=range(len(INJECTED)))
def test_compile_quotes_descriptions(tmp_path, capsys, baselines, field, text):
    texts = {f: f"plain {f.lower()} text" for f in FIELDS}
    texts[field] = text
    spec = tmp_path / "probe.yaml"
    spec.write_text(spec_text(texts), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["compile", str(spec), "-o", str(out), "--name", "m"]) == 0
    source = (out / "m" / "model.py").read_text(encoding="utf-8")
    values = constants(source)
    check_generated(source, texts, "probe.yaml", values["COMPILE_COMMAND"], baselines[SETTINGS[0]])


def test_spec_file_name_and_command_are_quoted(tmp_path, capsys, monkeypatch, baselines):
    """A file name with quotes, a backslash and a line break: the header quotes it, COMPILE_COMMAND
    holds it exactly (shell-quoted), and `specc check` recompiles from it."""
    texts = {f: f"plain {f.lower()} text" for f in FIELDS}
    name = 'we"""ird \'name\\\n.yaml'
    (tmp_path / name).write_text(spec_text(texts), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["compile", name, "-o", "gen", "--name", "m"]) == 0
    source = (tmp_path / "gen" / "m" / "model.py").read_text(encoding="utf-8")
    values = constants(source)
    assert shlex.split(values["COMPILE_COMMAND"])[:3] == ["specc", "compile", name]
    check_generated(source, texts, name, values["COMPILE_COMMAND"], baselines[SETTINGS[0]])
    capsys.readouterr()
    assert main(["check", "gen"]) == 0
    assert "1 generated module(s) checked, 0 stale file(s)" in capsys.readouterr().out


@given(text=TEXT)
@settings(max_examples=200, deadline=None)
def test_quoting_round_trips(text):
    assert ast.literal_eval(string_literal(text)) == text
    assert ast.literal_eval('"""' + docstring_text(text) + '"""') == text
    assert ast.literal_eval('"""x' + docstring_text(text) + 'y"""') == f"x{text}y"
    assert string_literal(text).isascii() and docstring_text(text).isascii()


def test_plain_text_is_written_as_is():
    text = "GPT-2 style decoder (124M): 'pre-norm', \"tied\" output; 50% {braces}."
    assert docstring_text(text) == text
    assert string_literal("specc compile specs/gpt.yaml --tp 2") == '"specc compile specs/gpt.yaml --tp 2"'


# -- names ------------------------------------------------------------------------------------

NAMES = SPEC.replace("@TOP@", '"t"').replace("@MODEL@", '"m"').replace("@LEAF@", '"l"').replace("@REF@", '"r"') \
    .replace("@MLP@", '"p"').replace("@HF@", '"h"')


def named_spec(module: str, submodule: str, variable: str, input_name: str) -> str:
    """The probe spec with the MLP module, its `fc2` submodule, its `y` variable and its `x`
    input renamed (names quoted for YAML; in steps they are plain text)."""
    text = NAMES.replace("module: MLP,", f"module: {yaml_quoted(module)},").replace("  MLP:", f"  {yaml_quoted(module)}:")
    text = text.replace("      fc2: {", f"      {yaml_quoted(submodule)}: {{")
    text = text.replace("- y = fc2(h)", f"- {yaml_quoted(f'{variable} = {submodule}(h)')}")
    text = text.replace("- return y", f"- {yaml_quoted(f'return {variable}')}")
    text = text.replace("inputs: [x]", f"inputs: [{yaml_quoted(input_name)}]")
    return text.replace("- h = fc1(x)", f"- {yaml_quoted(f'h = fc1({input_name})')}")


RESERVED_NAMES = sorted(RESERVED | MODULE_GLOBALS | NN_MODULE_ATTRS | {"__init__", "__class__", "__dict__", "__x"})
NAME = st.one_of(st.sampled_from(RESERVED_NAMES), st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,8}\Z"), TEXT)


@pytest.mark.parametrize("what,names", [
    ("submodule name", ("MLP", "forward", "y", "x")), ("submodule name", ("MLP", "training", "y", "x")),
    ("submodule name", ("MLP", "__init__", "y", "x")), ("module name", ("build_model", "fc2", "y", "x")),
    ("module name", ("COMPILE_COMMAND", "fc2", "y", "x")), ("variable", ("MLP", "fc2", "SPEC_SHA256", "x")),
    ("input", ("MLP", "fc2", "y", "__class__")),
])
def test_reserved_names_are_located_errors_and_nothing_is_written(tmp_path, capsys, what, names):
    spec = tmp_path / "probe.yaml"
    spec.write_text(named_spec(*names), encoding="utf-8")
    assert main(["compile", str(spec), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{spec}:") and "Traceback" not in err
    assert f": error: {what} '" in err and "is reserved in generated code" in err and "(rename it, e.g. '" in err
    assert not (tmp_path / "out").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(module=NAME, submodule=NAME, variable=NAME, input_name=NAME)
def test_any_accepted_name_builds_and_runs(folder, module, submodule, variable, input_name):
    """Names are arbitrary text or reserved words: each is refused with a located one-line error,
    or the module it compiles to runs with its constants and nn.Module intact."""
    torch = pytest.importorskip("torch")
    from runtime.api import load_module_from_source

    try:
        _, graph = compile_spec(folder, named_spec(module, submodule, variable, input_name), Settings(tp=1))
    except SpecError as e:
        line = e.format()
        assert "\n" not in line and ": error: " in line
        return
    for name in (module, submodule, variable, input_name):
        assert name.isidentifier() and name.isascii() and not name.startswith("__") and name not in RESERVED
        assert name not in MODULE_GLOBALS
    assert submodule not in NN_MODULE_ATTRS
    command = "specc compile probe.yaml"
    source = emit_model(graph, command)
    generated = load_module_from_source(source, "names")
    assert generated.SPEC_NAME == "textprobe" and generated.COMPILE_COMMAND == command
    assert generated.SETTINGS["tp"] == 1
    model = generated.build_model(seed=3)
    assert isinstance(model, torch.nn.Module)
    assert f"block.{submodule}.weight" in model.state_dict()  # the submodule is where its name says
    loss = model(torch.zeros(1, 8, dtype=torch.int64), torch.ones(1, 8, dtype=torch.int64))
    assert loss.shape == (1, 8) and torch.isfinite(loss).all()


VARIANTS = """\
name: variant
config: {hidden_size: 16, vocab_size: 32}
model:
  module: Model
  inputs:
    tokens: {shape: [1, 8], dtype: int64}
    labels: {shape: [1, 8], dtype: int64}
modules:
  Model:
    inputs: [tokens, labels]
    submodules:
      embedding: {op: embedding, num_embeddings: "${vocab_size}", embedding_dim: "${hidden_size}"}
      first: {module: Norm}
      second: {module: Norm}
      third: {module: Norm_2}
      output_layer: {op: linear, parallel: column, in_features: "${hidden_size}", out_features: "${vocab_size}"}
      loss: {op: cross_entropy}
    forward:
      - h = third(second(first(embedding(tokens))))
      - per_token_loss = loss(output_layer(h), labels)
      - return per_token_loss
  Norm:
    inputs: [x]
    submodules: {norm: {op: layernorm, hidden_size: "${hidden_size}"}}
    forward: [y = norm(x), return y]
  Norm_2:
    inputs: [x]
    submodules: {norm: {op: rmsnorm, hidden_size: "${hidden_size}"}}
    forward: [y = norm(x), return y]
"""


def test_a_layout_variant_never_takes_a_spec_module_name(folder):
    """At TP=2 the first Norm reduces the embedding's partial sums and the second does not: two
    classes. The variant must not be called Norm_2, which is another spec module's class."""
    path = os.path.join(folder, "variant.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(VARIANTS)
    _, graph = load_and_compile(path, Settings(tp=2), [])
    tree = ast.parse(emit_model(graph, "specc compile variant.yaml --tp 2"))
    classes = {n.name: ast.unparse(n) for n in tree.body if isinstance(n, ast.ClassDef)}
    assert len(classes) == len([n for n in tree.body if isinstance(n, ast.ClassDef)])  # no class defined twice
    built = dict(re.findall(r"self\.(first|second|third) = (\w+)\(pg", classes["Model"]))
    assert "RMSNorm" in classes[built["third"]] and "RMSNorm" not in classes[built["second"]]
    assert "LayerNorm" in classes[built["first"]] and "LayerNorm" in classes[built["second"]]
