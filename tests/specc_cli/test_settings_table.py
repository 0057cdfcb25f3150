"""The settings table (specc/settings.py) and what is derived from it agree: the flags parse back
to the settings the compile command records, training's ParallelConfig (the runtime's own copy)
holds the same parallel fields with the same defaults, and a rule's error names its flag."""

from __future__ import annotations

import dataclasses
import os
import shlex

import pytest

from runtime.train.config import ParallelConfig
from specc.errors import SpecError
from specc.layouts import GROUP_NAMES
from specc.settings import FLAG, TABLE, Settings
from specc_cli.args import settings_from
from specc_cli.main import build_parser
from specc_cli.train_args import build_rank_parser

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SPEC = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
RUNTIME_ONLY = {"pp_schedule", "dp", "transport"}  # what the runtime adds: the schedule, derived DP, the CPU transport

# every field away from its default, in two consistent combinations
SAMPLES = (
    Settings(tp=2, sp=True, cp=2, cp_comm_type="all_gather", recompute_granularity="full", recompute_method="block",
             recompute_num_layers=2, backend="native", micro_batch_size=3, dtype="fp16", fuse=False),
    Settings(tp=4, ep=2, etp=4, pp=4, pp_layout="Et*3|t*4|t*4|t*3L", recompute_granularity="selective"),
    Settings(pp=2, pp_virtual_stage_layers=2, reset_position_ids=True, reset_attention_mask=True),
    Settings(pp=3, pp_first_stage_layers=1, pp_last_stage_layers=2),
)


def test_every_field_is_given_by_some_sample():
    moved = {f.name for s in SAMPLES for f, _ in TABLE if getattr(s, f.name) != f.default}
    assert moved == {f.name for f, _ in TABLE}


@pytest.mark.parametrize("settings", SAMPLES, ids=lambda s: s.folder_suffix() or "default")
def test_the_compile_command_parses_back_to_the_same_settings(settings):
    words = shlex.split(" ".join(settings.command_flags()))
    assert settings_from(build_parser().parse_args(["compile", SPEC, *words])) == settings
    parallel = Settings(**settings.group("parallel"))  # training's parallel flags are the same flags
    rank = build_rank_parser().parse_args([SPEC, *shlex.split(" ".join(parallel.command_flags()))])
    assert {n: getattr(rank, n) for n in Settings.names("parallel")} == settings.group("parallel")


def test_the_runtime_parallel_config_agrees_field_by_field():
    runtime = {f.name: f.default for f in dataclasses.fields(ParallelConfig)}
    ours = {f.name: f.default for f, meta in TABLE if meta.group == "parallel"}
    assert {name: runtime.get(name, "missing") for name in ours} == ours
    assert set(runtime) - set(ours) == RUNTIME_ONLY


def test_describe_folder_and_settings_are_regular():
    s = SAMPLES[0]
    assert s.describe() == ("tp=2 sp=on cp=2 cp_comm_type=all_gather recompute=full/block/2 backend=native "
                            "micro_batch_size=3 dtype=fp16 fuse=off")
    assert s.folder_suffix() == "_tp2_sp_cp2_recompute_block2"
    assert list(s.as_dict()) == [f.name for f, _ in TABLE] == list(Settings().as_dict())
    assert Settings(recompute_granularity="full", recompute_method="uniform").recompute_num_layers == 1
    assert Settings(tp=2, cp=4).mesh().sizes == (("tp", 2), ("cp", 4))


@pytest.mark.parametrize("values, located", [
    (dict(tp=0), "--tensor-model-parallel-size: must be at least 1, got 0"),
    (dict(sp=True), "--sequence-parallel: needs --tensor-model-parallel-size 2 or more"),
    (dict(cp_comm_type="p2p"), "--cp-comm-type: has no effect without context parallelism"),
    (dict(ep=2, cp=2), "--expert-model-parallel-size: expert parallelism with context parallelism"),
    (dict(tp=2, etp=4), "--expert-tensor-parallel-size: 4 differs from the tensor-model-parallel size 2"),
    (dict(pp_layout="Et|tL"), "--pipeline-model-parallel-layout: has no effect without pipeline parallelism"),
    (dict(pp=2, pp_layout="Et|x"), "--pipeline-model-parallel-layout Et|x: unexpected 'x' in stage 1"),
    (dict(pp=2, pp_virtual_stage_layers=1, pp_first_stage_layers=1), "--decoder-first-pipeline-num-layers: "
     "cannot be combined with --num-layers-per-virtual-pipeline-stage"),
    (dict(recompute_method="block"), "--recompute-method block: has no effect without --recompute-granularity"),
    (dict(recompute_granularity="full"), "--recompute-granularity full: needs --recompute-method uniform or block"),
    (dict(dtype="fp8"), "--dtype: must be one of bf16, fp16, fp32, got 'fp8'"),
    (dict(tp="2"), "--tensor-model-parallel-size: must be an integer, got '2'"),
])
def test_a_broken_rule_is_one_line_at_its_flag(values, located):
    """On the command line; in code, a flag given to no effect and a value no flag offers pass."""
    with pytest.raises(SpecError) as e:
        Settings(**values).check_flags()
    loc, message = located.split(": ", 1)
    assert e.value.format().startswith(f"{loc}: error: {message}"), e.value.format()
    assert "\n" not in e.value.format()


def test_code_may_give_what_flags_refuse():
    assert Settings(sp=True).sp and Settings(backend="unfused").backend == "unfused"


def test_the_compilers_group_names_are_the_tables_flags():
    """layouts.GROUP_NAMES, what build_model's size checks and the divisibility errors below the
    table call each parallel group, is each size's Megatron flag in the table: --NAME-size."""
    assert {group: FLAG[group] for group in GROUP_NAMES} == {g: f"--{n}-size" for g, n in GROUP_NAMES.items()}
