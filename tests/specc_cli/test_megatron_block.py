"""A spec's `megatron:` block: Megatron's value flags set the config values the spec maps them to,
the structural flags a spec declares are accepted, any other is one line naming the shipped specs
that declare it (read from the specs, not a table), and a broken block is a located error."""

from __future__ import annotations

import os

import pytest

from specc.compiler import load_and_compile
from specc.errors import SpecError
from specc.frontend.model import Settings
from specc_cli.args import overrides_from
from specc_cli.main import build_parser, main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
LLAMA_TINY = os.path.join(ROOT, "specs", "llama-tiny.yaml")


def _config(argv):
    args = build_parser().parse_args(["plan", *argv])
    located = overrides_from(args)
    spec, _ = load_and_compile(args.spec, Settings(), located)
    return spec.config, {key: str(loc) for key, _, loc in located}


def test_value_flags_set_the_config_values_the_spec_maps():
    config, where = _config([GPT_TINY, "--kv-channels", "16", "--max-position-embeddings", "64",
                             "--init-method-std", "0.01", "--hidden-dropout", "0.1", "--attention-dropout=0.2",
                             "--norm-epsilon", "1e-6"])
    assert (config["head_dim"], config["max_position_embeddings"], config["init_std"]) == (16, 64, 0.01)
    assert (config["hidden_dropout"], config["attention_dropout"], config["layernorm_epsilon"]) == (0.1, 0.2, 1e-6)
    assert config["output_init_std"] == pytest.approx(0.01 / (2 * 2) ** 0.5)  # derived from the flag's value
    assert where["init_std"] == "--init-method-std 0.01"  # errors about a value point at the flag
    config, _ = _config([LLAMA_TINY, "--num-query-groups", "2", "--rotary-base", "500000", "--norm-epsilon",
                         "1e-6", "--kv-channels", "8"])
    assert (config["num_query_groups"], config["kv_size"], config["rotary_base"]) == (2, 16, 500000)
    assert config["norm_epsilon"] == 1e-6


def test_structural_flags_the_spec_declares_are_accepted():
    llama = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type=rope",
             "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--group-query-attention"]
    config, where = _config([LLAMA_TINY, *llama, "--num-query-groups", "4"])
    assert where == {"num_query_groups": "--num-query-groups 4"}
    _config([GPT_TINY, "--normalization", "layernorm", "--position-embedding-type", "learned_absolute"])


def _one_line(capsys, argv) -> str:
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    return captured.err.rstrip("\n")


def test_flags_the_spec_does_not_declare(capsys):
    err = _one_line(capsys, ["plan", LLAMA_TINY, "--hidden-dropout", "0.1"])
    assert err.startswith(f"error: --hidden-dropout 0.1: {LLAMA_TINY} maps no config value to --hidden-dropout")
    assert err.endswith("map it to hidden_dropout: specc plan specs/gpt.yaml --hidden-dropout 0.1)")
    err = _one_line(capsys, ["plan", LLAMA_TINY, "--normalization", "LayerNorm"])
    assert "specs/gpt.yaml" in err.split("(hint: ")[1] and "llama" not in err.split("(hint: ")[1]
    err = _one_line(capsys, ["plan", GPT_TINY, "--position-embedding-type", "alibi"])
    assert err.endswith("(hint: no shipped spec has --position-embedding-type alibi; they have "
                        "--position-embedding-type learned_absolute, none, rope)")
    err = _one_line(capsys, ["plan", GPT_TINY, "--init-method-std"])
    assert err == "error: argument --init-method-std: expected one argument (hint: see specc plan --help)"
    assert _one_line(capsys, ["plan", GPT_TINY, "--no-such-flag"]).startswith("error: unrecognized arguments: ")


def test_the_hint_comes_from_the_shipped_specs(capsys, tmp_path, monkeypatch):
    from specc.frontend import megatron_specs

    (tmp_path / "base.yaml").write_text(open(GPT_TINY.replace("gpt-tiny", "gpt")).read())
    (tmp_path / "relu2.yaml").write_text("name: relu2\nextends: base.yaml\nmegatron:\n  structure:\n"
                                         "    --apply-residual-connection-post-layernorm: true\n"
                                         "  flags:\n    --ffn-dim: ffn_hidden_size\n")
    err = _one_line(capsys, ["plan", GPT_TINY, "--apply-residual-connection-post-layernorm"])
    assert err.endswith("(hint: no shipped spec has that structure: write it in a spec (docs/spec-language.md))")
    monkeypatch.setattr(megatron_specs, "SHIPPED_SPECS", str(tmp_path))
    err = _one_line(capsys, ["plan", GPT_TINY, "--apply-residual-connection-post-layernorm"])
    assert err.endswith("(hint: specs/relu2.yaml has it: specc plan specs/relu2.yaml)")
    for i in range(5):
        (tmp_path / f"relu2-{i}.yaml").write_text(f"name: r{i}\nextends: relu2.yaml\n")
    err = _one_line(capsys, ["plan", GPT_TINY, "--apply-residual-connection-post-layernorm"])
    # the spec they extend first (name order would put relu2-0 before relu2), then the extensions
    assert err.endswith("(hint: specs/relu2.yaml, specs/relu2-0.yaml, specs/relu2-1.yaml, specs/relu2-2.yaml and "
                        "2 more have it: specc plan specs/relu2.yaml)")
    # a value flag another spec maps to a config value this spec has too: --set it, or map it here
    err = _one_line(capsys, ["plan", GPT_TINY, "--ffn-dim", "96"])
    assert err.endswith("(hint: --set ffn_hidden_size=96, or add '--ffn-dim: ffn_hidden_size' under megatron: "
                        "flags: in the spec)")


@pytest.mark.parametrize("block,error", [
    ("megatron: [1]", "3:11: error: 'megatron' must be a mapping (e.g. megatron: {flags: {--kv-channels: "
     "head_dim}})"),
    ("megatron: {flag: {}}", "3:12: error: unknown key 'flag' in 'megatron' (did you mean 'flags'?)"),
    ("megatron: {flags: {--kv-channels: head_dims}}", "3:35: error: --kv-channels must name a config value of the "
     "spec, got 'head_dims' (did you mean 'head_dim'?)"),
    ("megatron: {flags: {kv-channels: head_dim}}", "3:20: error: 'kv-channels' is not a Megatron flag name (e.g. --kv-channels)"),
    ("megatron: {flags: {--num-layers: num_layers}}", "3:20: error: --num-layers is a flag of specc validate, "
     "plan, graph, compile, verify and train itself, setting num_layers; a spec's megatron: block cannot map it "
     "again (drop it from the block: --num-layers N sets num_layers already)"),
    ("megatron: {structure: {--swiglu: 3}}", "3:34: error: --swiglu must be true (a flag without a value), false "
     "(not this structure) or the value that selects this spec's structure, got 3"),
])
def test_a_broken_block_is_a_located_error(capsys, tmp_path, block, error):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"extends: {os.path.join(ROOT, 'specs', 'gpt-tiny.yaml')}\nname: s\n{block}\n")
    assert main(["validate", str(spec)]) == 2
    assert capsys.readouterr().err == f"{spec}:{error}\n"
    for command in (["plan"], ["train", "--mock-data"]):  # reading the flags reports it too, located, in one line
        assert main([*command, str(spec), "--swiglu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{spec}:{error}") and err.count("\n") == 1 and err.count("error:") == 1, err


# -- only model flags: a flag a command reads itself never reaches the spec ------------------------

TRAIN_FLAG = ("is a flag of specc train ({group}), not a model setting; a spec's megatron: block maps only model "
              "flags (drop it from the block: the command line reads {flag} itself)")
SPEC_COMMANDS = "specc validate, plan, graph, compile and train"  # the commands of specc_cli.args.spec_flags, and train


@pytest.mark.parametrize("section,flag,line", [
    ("flags", "--lr", TRAIN_FLAG.format(group="optimizer and learning rate", flag="--lr")),
    ("flags", "--save", TRAIN_FLAG.format(group="checkpoints, logs", flag="--save")),
    ("flags", "--data-path", TRAIN_FLAG.format(group="data", flag="--data-path")),
    ("flags", "--tp", f"is a flag of {SPEC_COMMANDS.replace(' and train', ', verify and train')} (parallel settings), "
     "not a model setting; a spec's megatron: block maps only model flags (drop it from the block: the command line "
     "reads --tp itself)"),
    ("flags", "--tensor-model-parallel-size", f"is a flag of {SPEC_COMMANDS} (parallel settings), not a model "
     "setting; a spec's megatron: block maps only model flags (drop it from the block: the command line reads "
     "--tensor-model-parallel-size itself)"),
    ("flags", "--micro-batch-size", f"is a flag of {SPEC_COMMANDS} (parallel settings), not a model setting; a "
     "spec's megatron: block maps only model flags (drop it from the block: the command line reads "
     "--micro-batch-size itself)"),
    ("flags", "--micro", f"abbreviates --micro-batch-size, a flag of {SPEC_COMMANDS} (parallel settings): argparse "
     "reads it as that flag, not as a model setting; a spec's megatron: block maps only model flags (give the model "
     "flag its full Megatron name)"),
    ("structure", "--sequence-parallel", f"is a flag of {SPEC_COMMANDS} (parallel settings), not a model setting; "
     "a spec's megatron: block maps only model flags (drop it from the block: the command line reads "
     "--sequence-parallel itself)"),
])
def test_a_flag_the_command_line_reads_is_located_in_the_spec_on_every_command(capsys, tmp_path, monkeypatch,
                                                                                section, flag, line):
    import specc_cli.rank

    spec = tmp_path / "s.yaml"
    value = "head_dim" if section == "flags" else "true"
    spec.write_text(f"extends: {GPT_TINY}\nname: s\nmegatron:\n  {section}:\n    {flag}: {value}\n")
    error = f"{spec}:5:5: error: {flag} {line}"  # the key in the block
    # validate reports it among the other specs, which it still validates
    assert main(["validate", str(spec), GPT_TINY]) == 2
    captured = capsys.readouterr()
    assert captured.err == error + "\n" and captured.out.startswith(f"{GPT_TINY}: ok: ")
    # plan, with the flag or without it: the spec is wrong whatever the command line says
    assert _one_line(capsys, ["plan", spec]) == error
    assert _one_line(capsys, ["plan", spec, *(["--micro-batch-size", "2"] if flag == "--micro" else [])]) == error
    # train: parsing its flags refuses it (nothing launched)
    with pytest.raises(SpecError) as raised:
        build_parser().parse_args(["train", str(spec), "--mock-data"])
    assert raised.value.format() == error
    # the rank's own entry (torchrun -m specc_cli.rank) refuses what any specc command reads
    trained = []
    monkeypatch.setattr(specc_cli.rank, "run", lambda cfg, stream=None: trained.append(cfg) or 0)
    with pytest.raises(SystemExit) as exited:
        specc_cli.rank.rank_main([str(spec), "--mock-data", "--device", "cpu"])
    assert exited.value.code == 2 and not trained
    assert capsys.readouterr().err.startswith(f"{spec}:5:5: error: {flag} ")


def test_no_flag_of_any_command_can_be_mapped(tmp_path):
    """Every flag argparse defines for any specc command (and the rank's entry), read from the
    parsers, so a flag added to a command later is covered without a list to update here."""
    import argparse

    from specc.frontend.megatron import FLAG
    from specc_cli.train_args import build_rank_parser

    def flags_of(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from flags_of(sub)
            yield from (flag for flag in action.option_strings if flag.startswith("--"))

    parser = build_parser()
    flags = sorted({*flags_of(parser), *flags_of(build_rank_parser())})
    flags = [flag for flag in flags if FLAG.match(flag)]  # not --nproc_per_node: no Megatron flag is spelled so
    assert {"--lr", "--save", "--data-path", "--tp", "--micro-batch-size", "--tensor-model-parallel-size",
            "--json", "--nproc-per-node"} <= set(flags)  # plan's, train's, the launcher's
    spec = tmp_path / "s.yaml"
    for flag in flags:
        spec.write_text(f"extends: {GPT_TINY}\nname: s\nmegatron:\n  flags:\n    {flag}: head_dim\n")
        with pytest.raises(SpecError) as raised:
            parser.parse_args(["plan", str(spec)])
        assert raised.value.format().startswith(f"{spec}:5:5: error: {flag} is a flag of "), flag


def test_model_flags_no_command_reads_stay_the_spec_s(tmp_path):
    from specc_cli.args import CommandLineFlags

    flags = CommandLineFlags(build_parser())
    for flag in ("--kv-channels", "--num-query-groups", "--norm-epsilon", "--swiglu", "--rotary-base"):
        assert flags(flag) is None, flag
    spec = tmp_path / "s.yaml"  # declared false, a structure maps nothing: nothing to refuse
    spec.write_text(f"extends: {GPT_TINY}\nname: s\nmegatron:\n  structure:\n    --sequence-parallel: false\n")
    assert build_parser().parse_args(["plan", str(spec)]).spec == str(spec)
