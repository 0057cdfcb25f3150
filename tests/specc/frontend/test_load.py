"""Loading a spec: extends and deep merge, --set overrides, model inputs, the spec model."""

from __future__ import annotations

import textwrap

import pytest

from specc.errors import Loc, SpecError
from specc.frontend.load import load_spec
from specc.frontend.model import Leaf, Ref, Settings

from .conftest import BASE, ROOT, with_config

PARENT = with_config(BASE.replace("${4 * hidden_size}", "${ffn_hidden_size}"), ffn_hidden_size="${4 * hidden_size}")


def child(text: str) -> str:
    return "extends: parent.yaml\n" + textwrap.dedent(text)


# -- extends and merging ---------------------------------------------------------------------

def test_child_config_overrides_and_parent_expressions_see_it(write):
    write(PARENT, "parent.yaml")
    spec = load_spec(write(child("""\
        name: small
        config:
          hidden_size: 32
        """)))
    assert spec.name == "small"
    assert spec.config["hidden_size"] == 32 and spec.config["vocab_size"] == 256
    assert spec.config["ffn_hidden_size"] == 128  # late binding: the parent's ${4 * hidden_size} uses the child's value
    assert spec.modules["MLP"].submodules["fc1"].attrs["out_features"] == 128


def test_module_keys_merge_when_the_child_brings_no_forward(write):
    write(PARENT, "parent.yaml")
    spec = load_spec(write(child("""\
        modules:
          MLP:
            submodules:
              fc1: {bias: false}
              act: {op: silu}
        """)))
    subs = spec.modules["MLP"].submodules
    assert list(subs) == ["fc1", "act", "fc2"]
    assert subs["fc1"].attrs["bias"] is False and subs["fc1"].attrs["parallel"] == "column"
    assert subs["fc1"].attrs["out_features"] == 256
    assert subs["act"].op == "silu"
    assert [s.text for s in spec.modules["MLP"].steps] == ["h = fc1(x)", "h = act(h)", "y = fc2(h)", "return y"]


def test_a_child_module_with_its_own_forward_replaces_the_parents_whole_module(write):
    write(PARENT, "parent.yaml")
    spec = load_spec(write(child("""\
        modules:
          MLP:
            inputs: [x]
            submodules:
              fc: {op: linear, in_features: "${hidden_size}", out_features: "${hidden_size}"}
            forward:
              - y = fc(x)
              - return y
        """)))
    mlp = spec.modules["MLP"]
    assert list(mlp.submodules) == ["fc"]  # fc1, act and fc2 are gone, not merged in
    assert [s.text for s in mlp.steps] == ["y = fc(x)", "return y"]
    assert list(spec.modules) == ["Model", "MLP"]


def test_a_child_may_add_modules_and_replace_lists(write):
    write(PARENT, "parent.yaml")
    spec = load_spec(write(child("""\
        modules:
          Model:
            submodules:
              block: {module: Block, repeat: 3}
          Block:
            inputs: [x]
            submodules:
              mlp: {module: MLP}
            forward: ["y = x + mlp(x)", "return y"]
        """)))
    block = spec.modules["Model"].submodules["block"]
    assert isinstance(block, Ref) and block.module == "Block" and block.repeat == 3


def test_extends_chains_and_paths_relative_to_each_file(write):
    write(PARENT, "base/parent.yaml")
    write("extends: base/parent.yaml\nconfig:\n  vocab_size: 512\n", "middle.yaml")
    spec = load_spec(write("extends: ../middle.yaml\nname: leaf\nconfig:\n  hidden_size: 16\n", "sub/leaf.yaml"))
    assert (spec.name, spec.config["vocab_size"], spec.config["hidden_size"]) == ("leaf", 512, 16)


def test_errors_in_a_parent_point_into_the_parent(write):
    write(PARENT.replace("act: {op: gelu}", "act: {op: gleu}"), "parent.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(write(child("name: small\n")))
    assert info.value.loc.path.endswith("parent.yaml") and (info.value.loc.line, info.value.loc.col) == (24, 17)
    assert info.value.hint == "did you mean 'gelu'?"


def test_extends_cycle_is_reported_at_the_extends_that_closes_it(write):
    write("extends: b.yaml\nname: a\n", "a.yaml")
    write("name: b\nextends: a.yaml\n", "b.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(write("extends: a.yaml\nname: top\n", "top.yaml"))
    e = info.value
    assert e.what == "cycle in 'extends': a.yaml -> b.yaml -> a.yaml"
    assert e.loc.path.endswith("b.yaml") and (e.loc.line, e.loc.col) == (2, 10)


def test_a_spec_extending_itself(error):
    e = error("name: me\nextends: spec.yaml\n")
    assert e.what == "cycle in 'extends': spec.yaml -> spec.yaml"


def test_extends_of_a_missing_file(error):
    e = error("name: x\nextends: nowhere.yaml\n")
    assert e.what == "extended spec 'nowhere.yaml' not found" and (e.loc.line, e.loc.col) == (2, 10)


def test_shipped_children_merge_as_documented():
    spec = load_spec(str(ROOT / "specs" / "parallel-block-tiny.yaml"))
    layer = spec.modules["TransformerLayer"]
    assert list(layer.submodules) == ["input_layernorm", "self_attention", "mlp"]  # replaced whole
    assert spec.modules["MLP"].submodules["linear_fc1"].attrs["bias"] is False  # merged
    assert spec.modules["MLP"].submodules["linear_fc1"].attrs["parallel"] == "column"
    assert spec.config["hidden_size"] == 64 and spec.config["ffn_hidden_size"] == 256


# -- --set overrides -----------------------------------------------------------------------------

def set_(key, value):
    return (key, value, Loc(f"--set {key}={value}"))


def test_set_a_config_value(load):
    spec = load(PARENT, overrides=[set_("hidden_size", 32)])
    assert spec.config["hidden_size"] == 32 and spec.config["ffn_hidden_size"] == 128


def test_set_an_expression(load):
    spec = load(PARENT, overrides=[set_("ffn_hidden_size", "${3 * hidden_size}")])
    assert spec.config["ffn_hidden_size"] == 192


def test_set_a_dotted_path(load):
    spec = load(PARENT, overrides=[set_("modules.MLP.submodules.fc1.bias", False),
                                   set_("config.vocab_size", 512),
                                   set_("modules.MLP.submodules.fc2.init_std", 0.5)])  # a key the spec leaves out
    fc1, fc2 = spec.modules["MLP"].submodules["fc1"], spec.modules["MLP"].submodules["fc2"]
    assert isinstance(fc1, Leaf) and fc1.attrs["bias"] is False
    assert fc2.attrs["init_std"] == 0.5
    assert spec.config["vocab_size"] == 512


def test_set_an_unknown_config_value_suggests_the_closest(load):
    with pytest.raises(SpecError) as info:
        load(PARENT, overrides=[set_("hiden_size", 32)])
    assert info.value.format() == ("--set hiden_size=32: error: unknown config value 'hiden_size' "
                                   "(did you mean 'hidden_size'?)")


def test_set_an_unknown_path(load):
    with pytest.raises(SpecError) as info:
        load(PARENT, overrides=[set_("modules.MPL.forward", "x")])
    assert info.value.what == "'modules.MPL' is not in the spec" and info.value.hint == "did you mean 'MLP'?"


def test_a_key_added_by_set_is_validated_where_it_was_given(load):
    with pytest.raises(SpecError) as info:
        load(PARENT, overrides=[set_("modules.MLP.submodules.fc1.bais", False)])
    assert info.value.format() == ("--set modules.MLP.submodules.fc1.bais=False: error: unknown attribute 'bais' "
                                   "for op 'linear' (did you mean 'bias'?)")


def test_overrides_change_the_source_hash(load):
    a = load(PARENT)
    b = load(PARENT, overrides=[set_("hidden_size", 64)])
    assert a.source_hash != b.source_hash and a.source_hash == load(PARENT).source_hash


# -- the model and its inputs --------------------------------------------------------------------

def test_model_inputs(load):
    spec = load(BASE.replace("{shape: [micro_batch_size, 8], dtype: int64}", "{shape: [micro_batch_size, '${2 * 4}']}"),
                micro_batch_size=2)
    (tokens,) = spec.inputs
    assert (tokens.name, tokens.shape, tokens.dtype) == ("tokens", (2, 8), "int64")


@pytest.mark.parametrize("old, new, what", [
    ("    tokens: {shape: [micro_batch_size, 8], dtype: int64}\n", "    tokens: {dtype: int64}\n",
     "input 'tokens' is missing 'shape'"),
    ("  inputs:\n    tokens: {shape: [micro_batch_size, 8], dtype: int64}\n", "",
     "root input 'tokens' of module 'Model' has no declared shape"),
    ("[micro_batch_size, 8]", "[micro_batch_size, seq]", "shape entry 'seq' is not a config name"),
    ("[micro_batch_size, 8]", "[]", "'shape' must be a non-empty list"),
    ("[micro_batch_size, 8]", "[1, 0]", "shape dims must be positive, got 0"),
    ("dtype: int64", "dtype: int", "unknown dtype 'int'"),
    ("  module: Model\n", "", "'model' is missing 'module'"),
    ("  module: Model\n", "  module: MLP\n", "'tokens' is not an input of module 'MLP'"),
])
def test_model_input_errors(error, old, new, what):
    assert old in BASE
    assert what in error(BASE.replace(old, new, 1)).what


def test_the_spec_model(load):
    spec = load(BASE.replace("name: tiny\n", "name: tiny\ndescription: a test\nhf: {architecture: Foo}\n"))
    assert (spec.name, spec.description, spec.root, spec.hf) == ("tiny", "a test", "Model", {"architecture": "Foo"})
    emb = spec.modules["Model"].submodules["embedding"]
    assert emb.op == "embedding" and emb.impl == "auto"
    assert emb.attrs == {"num_embeddings": 256, "embedding_dim": 64, "init_std": 0.02, "parallel": "vocab"}
    assert emb.attr_locs["embedding_dim"].line == 15
    assert emb.name_loc.line == 15 and emb.name_loc.col == 7
    assert spec.settings == Settings()


@pytest.mark.parametrize("old, new, what", [
    ("act: {op: gelu}", "act: {op: gelu, impl: fast}", "unknown impl 'fast'"),
    ("act: {op: gelu}", "act: {op: gelu, impl: te}", "op 'gelu' has no 'te' implementation"),
    ("act: {op: gelu}", "act: {op: gelu, module: MLP}", "submodule 'act' has both 'op' and 'module'"),
    ("act: {op: gelu}", "act: {description: x}", "submodule 'act' needs 'op:'"),
    ("act: {op: gelu}", "act: {op: dropout, p: .nan}", "'p' must be a finite number, got nan"),
    ("act: {op: gelu}", "act: {op: dropout, p: -1}", "'p' must be at least 0.0, got -1.0"),
    ("block: {module: MLP}", "block: {module: MLP, repeat: 100001}", "repeat=100001 must be between 1 and 100000"),
    ('"${4 * hidden_size}"}', '"${4 * hidden_size}", segments: [128, 0]}', "'segments' entries must be positive"),
])
def test_submodule_errors(error, old, new, what):
    assert old in BASE
    assert what in error(BASE.replace(old, new, 1)).what


def test_the_expanded_model_size_is_bounded(error):
    text = BASE.replace("block: {module: MLP}", "block: {module: MLP, repeat: 30000}")
    e = error(text)
    assert e.what == "the model expands to more than 100,000 ops" and e.loc.line == 14


def test_settings_describe():
    assert Settings(tp=2, sp=True).describe() == ("tp=2 sp=on backend=auto micro_batch_size=1 dtype=bf16 fuse=on")


@pytest.mark.parametrize("value, hint", [
    ("1e-1", "YAML reads '1e-1' as a string: write exponents with a dot and a sign, e.g. 1.0e-5 or 6.4e+1"),
    ('"0.1"', "write it without quotes"),
    ("small", "write a number or ${expression}"),
])
def test_numbers_that_yaml_reads_as_strings(error, value, hint):
    e = error(BASE.replace("act: {op: gelu}", f"act: {{op: dropout, p: {value}}}"))
    assert e.what.startswith("'p' must be a number, got the string") and e.hint == hint
