"""Megatron-LM's own example scripts through `specc train` (issue 26): every flag of each script,
verbatim, with the sizes shrunk, either works as in Megatron, is accepted with a note in the log
where it has no effect on this backend (specc_cli/train_args.py MEGATRON_FLAG_FATES, a spec's
megatron.no_effect), or is refused with its reason, every refused flag of a command line on its own
line of one message. The lists are the scripts' *_ARGS arrays in order, from NVIDIA/Megatron-LM at
commit 779c5b748dbcf00ad9e36d539c576b404ab4abe9 (the last commit that changed all three; read at
d98e8a64dd). Shrunk: layers, hidden and FFN sizes, heads, query groups, sequence length, batch
sizes, iterations/samples, intervals, parallel sizes, data (--mock-data for --data-path), paths."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "runtime", "data"))
from tokenizer_files import sentencepiece_model  # noqa: E402

# examples/gpt3/train_gpt3_175b_distributed.sh (the script passes --step-batch-size-schedule's
# quoted value unquoted, so bash splits it; here it is the one argument it was meant to be)
GPT3 = [
    # DISTRIBUTED_ARGS
    "--nproc_per_node", "2", "--nnodes", "1", "--master_addr", "localhost", "--master_port", "29500",
    # GPT_MODEL_ARGS
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--attention-backend", "auto",
    # TRAINING_ARGS
    "--micro-batch-size", "1", "--global-batch-size", "4", "--step-batch-size-schedule", "0:2 64:4",
    "--train-iters", "2", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
    "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "2",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
    # DATA_ARGS
    "--data-path", "DATA/corpus_text_document", "--vocab-file", "DATA/gpt2-vocab.json", "--merge-file",
    "DATA/gpt2-merges.txt", "--split", "949,50,1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "1", "--save-interval", "1", "--eval-interval", "1", "--save", "CKPT", "--load", "CKPT",
    "--eval-iters", "1", "--tensorboard-dir", "TB",
]

# examples/llama/train_llama3_8b_h100_fp8.sh (DTYPE=fp8, the mock-data branch; its "--split '99,1,0'"
# reaches Megatron with the quotes, here without)
LLAMA3 = [
    # DISTRIBUTED_ARGS
    "--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0", "--master_addr", "localhost",
    "--master_port", "29500",
    # MODEL_ARGS
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96",
    "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "8",
    "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
    "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    # TRAINING_ARGS
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "8", "--lr-decay-samples", "8",
    "--lr-warmup-samples", "4", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    # DDP_ARGS (appended to TRAINING_ARGS)
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    # DTYPE_ARGS
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    # DATA_ARGS_LIST
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--data-cache-path", "CACHE",
    "--tiktoken-pattern", "v2", "--split", "99,1,0", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
    "--num-workers", "1",
    # EVAL_AND_LOGGING_ARGS
    "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
    "torch_dist", "--distributed-timeout-minutes", "60", "--save", "CKPT", "--load", "CKPT", "--tensorboard-dir", "TB",
]

# examples/mixtral/train_mixtral_8x7b_distributed.sh (LOGGING_ARGS without the W&B lines, which
# need WANDB_API_KEY)
MIXTRAL = [
    # DISTRIBUTED_ARGS
    "--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0", "--master_addr", "localhost",
    "--master_port", "29500",
    # MODEL_ARGS
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "16", "--max-position-embeddings", "32768",
    "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "16", "--num-attention-heads", "8",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "4", "--no-masked-softmax-fusion", "--no-position-embedding",
    "--rotary-base", "1000000",
    # MOE_ARGS
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather", "--overlap-grad-reduce",
    # DATA_ARGS
    "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "TOKENIZER_MODEL", "--mock-data",
    "--split", "99990,8,2",
    # TRAINING_ARGS
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "2",
    "--lr-decay-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
    # MODEL_PARALLEL_ARGS
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "2",
    "--use-distributed-optimizer", "--sequence-parallel",
    # LOGGING_ARGS
    "--log-interval", "1", "--save-interval", "1", "--eval-interval", "1", "--eval-iters", "1", "--save", "CKPT",
    "--load", "CKPT", "--tensorboard-dir", "CKPT/tensorboard", "--no-load-optim", "--no-load-rng",
]

# Each script's fate, flag by flag: refused (with a word of the reason), no effect (a note in the
# log; the spec's megatron.no_effect or the table), warned (works, with a note where Megatron warns
# and carries on). Every other flag works: a setting of specc train, or the spec's (megatron.flags,
# structure).
FATES = {
    "gpt3": ("specs/gpt-tiny.yaml", GPT3, {
        "refused": {"--step-batch-size-schedule": "step-wise batch-size schedule is not implemented"},
        "no effect": {"--attention-backend"},
        "resolve": ["--vocab-file and --merge-file without --tokenizer-type"],  # as Megatron: no type, no tokenizer
    }),
    "llama3": ("specs/llama3-tiny.yaml", LLAMA3, {
        "refused": {
            "--apply-layernorm-1p": "does not declare this structure",  # llama's RMSNorm scales by gamma, not 1+gamma
            "--grad-reduce-in-bf16": "reduced in fp32", "--fp8-format": "FP8 training",
            "--fp8-amax-history-len": "FP8 training", "--fp8-amax-compute-algo": "FP8 training",
            "--fp8-param-gather": "FP8 training",
        },
        "no effect": {"--use-mcore-models", "--max-position-embeddings", "--attention-backend",
                      "--cross-entropy-loss-fusion", "--manual-gc",
                      "--empty-unused-memory-level", "--data-cache-path", "--no-create-attention-mask-in-dataloader",
                      "--no-mmap-bin-files", "--num-workers", "--profile", "--profile-step-start", "--profile-step-end"},
        "warned": {"--sequence-parallel"},  # at TP 1: off, as Megatron turns it off
        "resolve": [],
    }),
    "mixtral": ("specs/mixtral-tiny.yaml", MIXTRAL, {
        "refused": {},
        "no effect": {"--use-mcore-models", "--max-position-embeddings", "--no-masked-softmax-fusion",
                      "--moe-grouped-gemm", "--moe-token-dispatcher-type"},
        "warned": {"--sequence-parallel"},
        "resolve": [],
    }),
}
COUNTS = {  # works / no effect / refused, of each script's flags (docs/training.md's table)
    "gpt3": (36, 1, 1), "llama3": (61, 13, 6), "mixtral": (57, 5, 0),
}


def _groups(words: list) -> list:
    """[flag, its values...] per flag of a command line."""
    out = []
    for word in words:
        if word.startswith("--"):
            out.append([word])
        else:
            out[-1].append(word)
    return out


def _parse(spec: str, words: list):
    from specc_cli.args import ArgumentParser
    from specc_cli.train import add_parsers

    parser = ArgumentParser(prog="specc")
    add_parsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(["train", spec, *words])


@pytest.mark.parametrize("script", sorted(FATES))
def test_every_flag_of_megatrons_example_script_works_has_no_effect_or_is_refused(script):
    from runtime.train.config import resolve
    from specc_cli.args import UsageError, UsageErrors
    from specc_cli.train_config import config_from_args

    spec, words, fate = FATES[script]
    flags = [group[0] for group in _groups(words)]
    assert len(flags) == len(set(flags)), "a script gives each flag once"
    refused = fate["refused"]
    if refused:  # all of them in one message, one line each, in the order given
        with pytest.raises(UsageError) as e:
            _parse(spec, words)
        lines = e.value.format().splitlines()
        assert len(lines) == len(refused) and isinstance(e.value, UsageErrors) == (len(refused) > 1)
        assert [line.split()[1].rstrip(":") for line in lines] == [f for f in flags if f in refused]
        for line in lines:
            flag = line.split()[1].rstrip(":")
            assert line.startswith("error: ") and refused[flag] in line, line
    kept = [word for group in _groups(words) if group[0] not in refused for word in group]
    args = _parse(spec, kept)
    cfg = config_from_args(args)
    world = args.nproc_per_node * args.nnodes
    errors = resolve(cfg, world)
    assert len(errors) == len(fate["resolve"]) and all(want in got for want, got in zip(fate["resolve"], errors)), errors
    noted = {note.split()[0].rstrip(":") for note in cfg.notes}
    assert noted == fate["no effect"] | fate.get("warned", set()), cfg.notes
    assert len(cfg.notes) == len(set(cfg.notes))  # each once
    for note in cfg.notes:
        assert "no effect" in note or "as Megatron" in note, note
    works = [f for f in flags if f not in refused and f not in fate["no effect"]]
    assert (len(works), len(fate["no effect"]), len(refused)) == COUNTS[script]


def test_refused_and_unknown_flags_are_reported_together_one_line_each(specc):
    code, out, err = specc("train", "specs/llama3-tiny.yaml", "--fp8-format", "hybrid", "--bogus", "1",
                           "--lr", "1e-3", "--grad-reduce-in-bf16", "--attention-backend", "fused",
                           "--apply-layernorm-1p", "--squared-relu")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 5, err
    assert [line.split()[1].rstrip(":") for line in lines] == [
        "--fp8-format", "unrecognized", "--grad-reduce-in-bf16", "--apply-layernorm-1p", "--squared-relu"]
    assert "error: unrecognized arguments: --bogus 1" in lines[1]
    assert all(line.startswith("error: ") for line in lines)


def test_a_spec_states_which_megatron_flags_change_nothing_in_its_model():
    from specc.errors import SpecError
    from specc.frontend.megatron import check_megatron
    from specc.frontend.yamlload import load_yaml

    raw = load_yaml("megatron:\n  no_effect:\n    --max-position-embeddings: rotary, any length\n", "s.yaml")
    block = check_megatron(raw["megatron"], raw.value_loc("megatron"), load_yaml("a: 1\n", "s.yaml"))
    assert block.no_effect == {"--max-position-embeddings": "rotary, any length"}
    for text, why in (("  no_effect:\n    --x: ''\n", "must say why"),
                      ("  structure:\n    --x: true\n  no_effect:\n    --x: because\n", "more than one")):
        raw = load_yaml("megatron:\n" + text, "s.yaml")
        with pytest.raises(SpecError, match=why):
            check_megatron(raw["megatron"], raw.value_loc("megatron"), load_yaml("a: 1\n", "s.yaml"))
    # a number is a number: Megatron's --attention-dropout 0 is the spec's "0.0"; 0.1 is not
    assert _parse("specs/mixtral-tiny.yaml", ["--attention-dropout", "0"]).spec_flag_overrides == []
    with pytest.raises(SystemExit):
        _parse("specs/mixtral-tiny.yaml", ["--attention-dropout", "0.1"])


def test_exit_duration_and_no_load_rng_rules(tmp_path):
    from runtime.train.config import TrainConfig, resolve
    from specc_torch.train_checks import _no_load_rng_rules

    cfg = TrainConfig(spec="s.yaml", exit_duration_in_mins=-1.0)
    assert any("--exit-duration-in-mins must be" in e for e in resolve(cfg, 1))
    cfg = TrainConfig(spec="s.yaml", exit_duration_in_mins=0.0)
    cfg.checkpoint.no_load_rng = True
    assert resolve(cfg, 1) == [] and cfg.notes == ["--no-load-rng without --load: no effect (nothing is loaded)"]
    cfg.checkpoint.load = str(tmp_path)  # nothing there yet: no effect, said once
    assert _no_load_rng_rules(cfg) == [] and cfg.notes[-1] == f"--no-load-rng: no effect (no checkpoint in --load " \
        f"{tmp_path} yet)"
    (tmp_path / "latest").write_text("1\n")  # a checkpoint that would load restores its RNG states: refused
    assert "holds a checkpoint, and loading restores its RNG states" in _no_load_rng_rules(cfg)[0]


def test_mixtral_script_trains_two_iterations_and_exit_duration_stops_it(specc, tmp_path):
    """The Mixtral script, flags verbatim and sizes shrunk (1 rank: EP 1), trains 2 iterations end
    to end with its notes in the log (one rank runs in this process: --master_port is unused); with Llama's --exit-duration-in-mins 0 it stops after the
    first iteration and saves there."""
    model = sentencepiece_model(tmp_path)
    words = [w.replace("TOKENIZER_MODEL", model).replace("CKPT", str(tmp_path / "ckpt")) for w in MIXTRAL]
    words[words.index("--nproc_per_node") + 1] = "1"
    words[words.index("--expert-model-parallel-size") + 1] = "1"
    code, out, err = specc("train", "specs/mixtral-tiny.yaml", *words, "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 0, err[-3000:]
    for flag in FATES["mixtral"][2]["no effect"] | FATES["mixtral"][2]["warned"]:
        assert out.count(f"note: {flag}") == 1, (flag, out)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["iteration"] for r in records if r["kind"] == "train"] == [1, 2]
    words = [w.replace(str(tmp_path / "ckpt"), str(tmp_path / "ckpt2")) for w in words]
    for flag in ("--train-iters", "--lr-decay-iters"):
        words[words.index(flag) + 1] = "5"
    code, out, err = specc("train", "specs/mixtral-tiny.yaml", *words, "--run-dir", tmp_path / "run2",
                           "--no-progress", "--exit-duration-in-mins", "0")
    assert code == 0, err[-3000:]
    assert "exiting after iteration 1: the run has trained for more than --exit-duration-in-mins 0" in out
    assert open(tmp_path / "ckpt2" / "latest").read().strip().endswith("1")
