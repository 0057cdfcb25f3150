"""`specc plan SPEC --FLAG V` and `specc train SPEC --FLAG V` build the same model. A flag a spec's
`megatron:` block maps resolves to the same config overrides in plan (specc_cli.args.overrides_from),
in train's configuration (specc_torch.train.config_from_args: what the launcher checks and every
rank compiles) and at the rank's own entry (torchrun -m specc_cli.rank); a flag either
command reads itself cannot be mapped at all, so no flag means one thing to plan and another to
train. Nothing is trained here: the rank's `run` is replaced by one that keeps its configuration."""

from __future__ import annotations

import os

import pytest

import specc_cli.rank
import specc_cli.train_config
import specc_torch.train_compile
from specc.compiler import load_and_compile
from specc.errors import SpecError
from specc.frontend.megatron import FLAG
from specc.frontend.megatron_specs import shipped
from specc_cli.args import overrides_from, settings_from
from specc_cli.main import build_parser

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
LLAMA_TINY = os.path.join(ROOT, "specs", "llama-tiny.yaml")


@pytest.fixture
def resolve(monkeypatch):
    """resolve(spec, *flags) -> (plan's args, train's TrainConfig, the rank's TrainConfig)."""
    configs, parser = [], build_parser()
    monkeypatch.setattr(specc_cli.rank, "run", lambda cfg, stream=None: configs.append(cfg) or 0)

    def run(spec, *flags):
        plan = parser.parse_args(["plan", spec, *flags])
        train = specc_cli.train_config.config_from_args(parser.parse_args(["train", spec, *flags]))
        assert specc_cli.rank.rank_main([spec, *flags]) == 0
        return plan, train, configs.pop()

    return run


def _mapped():
    """(spec, flag, config name) for every mapping of a flag to a config name in the shipped specs
    (the first spec that has it)."""
    first = {}
    for path, m in shipped():
        for flag, key in sorted(m.flags.items()):
            first.setdefault((flag, key), os.path.join(ROOT, path))
    return [(spec, flag, key) for (flag, key), spec in first.items()]


def test_every_flag_a_shipped_spec_maps_resolves_alike_in_plan_and_train(resolve):
    mapped = _mapped()
    assert {flag for _, flag, _ in mapped} >= {"--kv-channels", "--num-query-groups", "--norm-epsilon"}
    for i, (spec, flag, key) in enumerate(mapped):
        given = [flag, "7"] if i % 2 else [f"{flag}=7"]
        plan, train, rank = resolve(spec, *given)
        planned = {k: v for k, v, _ in overrides_from(plan)}
        assert planned == train.overrides == rank.overrides == {key: 7}, (spec, given)


@pytest.mark.parametrize("spec,flags", [
    (GPT_TINY, ["--kv-channels", "16", "--init-method-std", "0.01", "--hidden-dropout", "0.1",
                "--attention-dropout=0.2", "--norm-epsilon", "1e-6", "--num-layers", "3"]),
    (LLAMA_TINY, ["--num-query-groups", "2", "--rotary-base", "500000", "--norm-epsilon", "1e-6",
                  "--kv-channels", "8", "--swiglu", "--normalization", "RMSNorm", "--tp", "2"]),
])
def test_plan_and_train_compile_the_same_config(resolve, spec, flags):
    plan, train, rank = resolve(spec, *flags)
    planned, _ = load_and_compile(plan.spec, settings_from(plan), overrides_from(plan))
    trained = specc_torch.train_compile.compile_model(train)[1]
    assert planned.config == trained.config == specc_torch.train_compile.compile_model(rank)[1].config
    assert planned.config["head_dim"] == (8 if spec == LLAMA_TINY else 16)
    assert planned.config["norm_epsilon" if spec == LLAMA_TINY else "layernorm_epsilon"] == 1e-6


def test_a_flag_plan_or_train_reads_itself_is_refused_by_both_alike(tmp_path):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    flags = sorted({flag for command in ("plan", "train") for action in sub[command]._actions
                    for flag in action.option_strings if flag.startswith("--")})  # read from argparse
    flags = [flag for flag in flags if FLAG.match(flag)]  # not --nproc_per_node: no Megatron flag is spelled so
    assert {"--lr", "--save", "--data-path", "--tp", "--micro-batch-size", "--json"} <= set(flags)
    spec = tmp_path / "s.yaml"
    for flag in flags:
        spec.write_text(f"extends: {GPT_TINY}\nname: s\nmegatron:\n  flags:\n    {flag}: head_dim\n")
        errors = []
        for command in ("plan", "train"):
            with pytest.raises(SpecError) as raised:
                parser.parse_args([command, str(spec)])
            errors.append(raised.value.format())
        assert errors[0] == errors[1] and errors[0].startswith(f"{spec}:5:5: error: {flag} is a flag of "), errors
