"""The flags of `specc train SPEC [flags]` and of one training rank launched by hand, `torchrun
... -m specc_cli.rank SPEC [flags]`: Megatron's names with Megatron's meaning (Megatron's model
flags are the spec's: specc_cli/megatron_flags.py). Parsing only: the command that launches is
specc_cli/train.py, the rank's entry specc_cli/rank.py."""

from __future__ import annotations

import argparse
import sys

from specc.errors import SpecError
from specc.settings import Settings
from specc_cli.args import (
    MEGATRON_CONFIG_FLAGS,
    ArgumentParser,
    UsageError,
    add_flag_table,
    add_settings_flags,
    recompute_flags,
)

from .data import add_tokenizer_arguments

_FUSION = "a CUDA kernel fusion switch: the ops compute the same values unfused"
_FP8 = "FP8 training (TransformerEngine's scaled FP8 GEMMs) is not implemented: train in --bf16"
_STEP_SCHEDULE = ("Megatron's step-wise batch-size schedule is not implemented: the global batch is "
                  "--global-batch-size, or grows by --rampup-batch-size START INCREMENT SAMPLES")

# Megatron's training flags that are neither a setting here nor the spec's (specc_cli/megatron_flags.py):
# (flag, number of values, fate, why). "no effect": accepted, and the run's log says once why it
# changes nothing on this backend (kernel choices, Megatron's internals); "refused": one line with
# the reason, all of a command line's together. A flag that changes the numerics or the model is
# never "no effect": it works (a setting, or the spec's megatron: block) or it is refused.
MEGATRON_FLAG_FATES = (
    ("--use-mcore-models", 0, "no effect", "the model is the spec's, built by specc, not a Megatron model class"),
    ("--attention-backend", 1, "no effect", "the attention kernel is the plan's choice for the spec's core_attention "
     "op; every kernel computes the same attention"),
    ("--use-flash-attn", 0, "no effect", "the attention kernel is the plan's choice (flash-attn where installed and "
     "chosen); every kernel computes the same attention"),
    ("--transformer-impl", 1, "no effect", "each op's implementation is the plan's choice (specc plan --backend); "
     "they compute the same values"),
    ("--no-masked-softmax-fusion", 0, "no effect", _FUSION),
    ("--no-bias-gelu-fusion", 0, "no effect", _FUSION),
    ("--no-bias-swiglu-fusion", 0, "no effect", _FUSION),
    ("--no-bias-dropout-fusion", 0, "no effect", _FUSION),
    ("--no-rope-fusion", 0, "no effect", _FUSION),
    ("--no-persist-layer-norm", 0, "no effect", _FUSION),
    ("--cross-entropy-loss-fusion", 0, "no effect", _FUSION),
    ("--moe-permute-fusion", 0, "no effect", _FUSION),
    ("--no-gradient-accumulation-fusion", 0, "no effect", "gradients are accumulated into the fp32 main_grad "
     "buffer by a hook either way; the fused kernel only does it inside the weight-gradient GEMM"),
    ("--moe-grouped-gemm", 0, "no effect", "a kernel choice for the experts' GEMMs: the experts compute the same"),
    ("--moe-token-dispatcher-type", 1, "no effect", "the moe op dispatches tokens by all-to-all over the "
     "expert-parallel group; Megatron's dispatchers differ in communication, not in the result"),
    ("--tp-comm-overlap", 0, "no effect", "TransformerEngine's overlap of tensor-parallel communication with GEMMs "
     "(userbuffers): timing only, the same values"),
    ("--manual-gc", 0, "no effect", "when Python's garbage collector runs: timing only"),
    ("--manual-gc-interval", 1, "no effect", "when Python's garbage collector runs: timing only"),
    ("--num-workers", 1, "no effect", "samples are read in the training process, no DataLoader workers"),
    ("--no-create-attention-mask-in-dataloader", 0, "no effect", "the data never builds an attention mask: "
     "attention is causal inside the kernel (with --reset-attention-mask, refused beside it, document ids)"),
    ("--no-mmap-bin-files", 0, "no effect", "how the .bin file is read, not what: the same samples"),
    ("--data-cache-path", 1, "no effect", "the sample indices are built in memory at the start of each run; "
     "nothing is cached on disk"),
    ("--empty-unused-memory-level", 1, "no effect", "Megatron's torch.cuda.empty_cache() calls between steps: "
     "the allocator's cache only, the same training"),
    ("--profile", 0, "no effect", "the CUDA profiler range for an nsys capture is not marked; use torch.profiler "
     "or py-spy around the run"),
    ("--profile-step-start", 1, "no effect", "goes with --profile (the nsys capture range), not marked here"),
    ("--profile-step-end", 1, "no effect", "goes with --profile (the nsys capture range), not marked here"),
    ("--tensorboard-queue-size", 1, "no effect", "how many events the TensorBoard writer holds before it writes "
     "them: the same event files"),
    ("--step-batch-size-schedule", 1, "refused", _STEP_SCHEDULE),
    ("--grad-reduce-in-bf16", 0, "refused", "gradients are accumulated and reduced in fp32 here (the fp32 "
     "main_grad buffer); reducing them in bf16 is not implemented"),
    ("--fp8-format", 1, "refused", _FP8),
    ("--fp8-amax-history-len", 1, "refused", _FP8),
    ("--fp8-amax-compute-algo", 1, "refused", _FP8),
    ("--fp8-param-gather", 0, "refused", _FP8),
)

LAUNCH_FLAGS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend",
                "rdzv_endpoint", "rdzv_id", "max_restarts")


def add_train_arguments(p: argparse.ArgumentParser, launcher: bool) -> None:
    p.add_argument("spec", metavar="SPEC", help="a model spec (.yaml)")
    if launcher:
        g = p.add_argument_group("launch (passed to torchrun)")
        g.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
                       help="ranks on this node (default 1: run in this process)")
        g.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes (default 1)")
        g.add_argument("--node-rank", "--node_rank", type=int, default=None, metavar="R")
        g.add_argument("--master-addr", "--master_addr", default=None, metavar="HOST")
        g.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT")
        g.add_argument("--rdzv-backend", "--rdzv_backend", default=None)
        g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT")
        g.add_argument("--rdzv-id", "--rdzv_id", default=None)
        g.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="R",
                       help="torchrun's elastic restarts after a rank fails (default 0); a restarted run resumes "
                       "from the latest checkpoint in --save")

    g = p.add_argument_group("parallelism")
    add_settings_flags(g, Settings.names("parallel"), megatron_first=True)
    g.add_argument("--pipeline-schedule", dest="pp_schedule", default=None,
                   choices=("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble"),
                   help="torch.distributed.pipelining schedule (default 1f1b; interleaved_1f1b with virtual stages)")
    g.add_argument("--collective-transport", dest="transport", choices=("auto", "shm", "torch"), default="auto",
                   help="CPU tensors' collectives within a host: shm (shared memory), torch (torch.distributed, "
                   "gloo), or auto (shared memory where the host has a core per rank)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard Adam state and fp32 master weights over the data-parallel ranks")
    g.add_argument("--ddp-bucket-size", type=int, default=4_000_000, metavar="ELEMENTS",
                   help="gradient elements per data-parallel bucket (default 4000000)")
    g.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="reduce gradients after backward instead of overlapping with it")
    g.add_argument("--overlap-grad-reduce", dest="overlap_grad_reduce", action="store_true",
                   help="overlap each gradient bucket's reduction with backward (the default; Megatron's flag)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: each bucket's parameter all-gather runs until the next "
                   "forward reaches a module that uses it")

    g = p.add_argument_group("model (override the spec's config)")
    for key, flag in MEGATRON_CONFIG_FLAGS.items():
        g.add_argument(flag, dest=f"cfg_{key}", type=int, default=None, metavar="N")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config value of the spec; repeatable")

    g = p.add_argument_group("training")
    add_settings_flags(g, ("micro_batch_size",), megatron_first=True)
    g.add_argument("--global-batch-size", type=int, default=None, metavar="B",
                   help="default: micro batch * DP (no accumulation)")
    g.add_argument("--train-iters", type=int, default=None, metavar="N", help="default 100")
    g.add_argument("--train-samples", type=int, default=None, metavar="N",
                   help="instead of --train-iters: iterations = N // global batch, and the lr schedule counts samples")
    g.add_argument("--exit-interval", type=int, default=None, metavar="N",
                   help="stop after an iteration divisible by N (saving a checkpoint with --save)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="MINUTES",
                   help="stop after the first iteration that ends more than MINUTES after training started "
                   "(saving a checkpoint with --save)")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: the global batch starts at START and grows by INCREMENT up to "
                   "--global-batch-size over the first SAMPLES samples (Megatron's ramp-up)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss of a step is summed over the global batch's loss tokens and divided by their "
                   "number (all micro-batches, all DP ranks), not the mean of the micro-batches' means")
    g.add_argument("--distributed-timeout-minutes", type=int, default=None, metavar="MINUTES",
                   help="the process groups' timeout for a collective (default torch's: 30)")
    g.add_argument("--eval-interval", type=int, default=1000, metavar="N")
    g.add_argument("--eval-iters", type=int, default=10, metavar="N", help="global batches per evaluation (0: none)")
    g.add_argument("--log-interval", type=int, default=100, metavar="N")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and autocast, fp32 master weights and grads")
    g.add_argument("--fp16", action="store_true", help="fp16 parameters and autocast, fp32 master weights and grads, "
                   "loss scaling (dynamic unless --loss-scale)")
    g.add_argument("--loss-scale", type=float, default=None, metavar="S", help="fp16: a fixed loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, metavar="S",
                   help="fp16 dynamic loss scaling: the first scale (default 2**32)")
    g.add_argument("--min-loss-scale", type=float, default=1.0, metavar="S", help="fp16: the smallest scale (1)")
    g.add_argument("--loss-scale-window", type=int, default=1000, metavar="N",
                   help="fp16: steps without an overflow before the scale doubles (1000)")
    g.add_argument("--hysteresis", type=int, default=2, metavar="N",
                   help="fp16: overflows tolerated before the scale halves (2)")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--host-memory", dest="host_memory", default="retain", choices=("retain", "release"),
                   help="on the CPU, memory a step frees: retain (kept in the process for the next step: no page "
                   "faults to map it again) or release (glibc's defaults: back to the kernel)")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile each repeated layer (regionally, as torchtitan does)")
    g.add_argument("--torch-compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                   help="the torch.compile backend (default inductor)")

    recompute_flags(p)

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=("adam", "sgd"),
                   help="adam (AdamW: decoupled weight decay) or sgd (with --sgd-momentum, L2 weight decay)")
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--lr", type=float, default=1.0e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0, metavar="N")
    g.add_argument("--lr-warmup-samples", type=int, default=0, metavar="N", help="with --train-samples")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, metavar="F",
                   help="warmup as a fraction of the decay iterations (or samples)")
    g.add_argument("--lr-decay-style", default="linear", choices=("constant", "linear", "cosine", "WSD"))
    g.add_argument("--lr-decay-iters", type=int, default=None, metavar="N", help="default: --train-iters")
    g.add_argument("--lr-decay-samples", type=int, default=None, metavar="N", help="default: --train-samples")
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=("linear", "cosine", "exponential",
                                                                           "minus_sqrt"),
                   help="WSD: the shape of the final decay (default exponential)")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, metavar="N",
                   help="WSD: the final decay's length, ending at the decay iterations")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, metavar="N", help="WSD with --train-samples")
    g.add_argument("--decoupled-lr", type=float, default=None, metavar="LR",
                   help="the word embedding's and the output layer's weights: their own peak lr, same schedule")
    g.add_argument("--decoupled-min-lr", type=float, default=None, metavar="LR",
                   help="their own min lr, with --decoupled-lr (default --min-lr)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1.0e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient norm limit (0: no clipping)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None, metavar="PREFIX",
                   help="a Megatron indexed dataset (PREFIX.bin + PREFIX.idx, from Megatron's preprocess_data or "
                   "`specc data prepare`), or a blend: WEIGHT PREFIX WEIGHT PREFIX ... (default: the Python standard "
                   "library's sources, byte tokenizer, prepared into RUN_DIR/data)")
    g.add_argument("--split", default="969,30,1", metavar="TRAIN,VALID[,TEST]",
                   help="train, valid, test weights over each dataset's documents (default 969,30,1)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="+", default=None, metavar="PREFIX",
                       help=f"the {split} split's own dataset or blend, read whole (instead of --data-path and --split)")
    g.add_argument("--mock-data", action="store_true", help="seeded random tokens instead of a dataset (no files)")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the end-of-document token (the tokenizer's, or the one "
                   "`specc data prepare` recorded)")
    # the model is compiled to take each token's position and document (specc/frontend/packed.py)
    add_settings_flags(g, ("reset_position_ids", "reset_attention_mask"), megatron_first=True)

    g = p.add_argument_group("tokenizer (sizes the model's vocabulary; the data is already tokenized)")
    add_tokenizer_arguments(g)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                   help="the model's vocab_size: the tokenizer's padded to a multiple of N x TP (default 128)")

    g = p.add_argument_group("checkpoints, logs")
    g.add_argument("--save", default=None, metavar="DIR")
    g.add_argument("--load", default=None, metavar="DIR")
    g.add_argument("--save-interval", type=int, default=None, metavar="N")
    g.add_argument("--keep-last", type=int, default=None, metavar="K",
                   help="keep only the newest K checkpoints in --save (default: all)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="--load the weights, iteration and data position, with a fresh optimizer")
    g.add_argument("--no-load-rng", action="store_true",
                   help="Megatron's: accepted where nothing is loaded (no --load, or a --save X --load X that holds "
                   "no checkpoint yet); a checkpoint loaded restores its RNG states, so with one it is refused")
    g.add_argument("--ckpt-format", default=None, metavar="FORMAT",
                   help="Megatron's: torch_dist also writes each save as Megatron Core's torch_dist iter_N/ (weights "
                   "only) in --save, beside specc's own checkpoint, which a --load of DIR resumes")
    g.add_argument("--finetune", action="store_true",
                   help="--load the weights only: iteration 0, a fresh optimizer, the data from its start")
    g.add_argument("--allow-spec-change", action="store_true",
                   help="--load a checkpoint saved from another version of the spec (names and shapes still must match)")
    g.add_argument("--run-dir", default=None, metavar="DIR",
                   help="config.json, model.py, plan.txt, plan.json, metrics.jsonl, tensorboard/ (default runs/SPEC_NAME)")
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress bar (default: when stderr is a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g.add_argument("--log-throughput", action="store_true",
                   help="accepted for Megatron's scripts: the log line always shows the throughput")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="TensorBoard event files (default RUN_DIR/tensorboard)")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, metavar="N",
                   help="write the TensorBoard scalars every N iterations (default 1)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="also iteration-time (and with --log-throughput, throughput: TFLOP/s per GPU)")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard",
                   dest="log_loss_scale_to_tensorboard", action="store_false", help="leave out loss-scale")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also 'lm loss validation ppl'")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="also world-size")
    g.add_argument("--wandb-project", default=None, metavar="NAME",
                   help="also log to Weights & Biases in this project (needs the wandb package)")
    g.add_argument("--wandb-exp-name", default=None, metavar="NAME", help="the W&B run's name")
    g.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOPS",
                   help="the peak TFLOP/s of one rank, for MFU (default: measured once with a GEMM of the run's "
                   "dtype on its device and thread count)")

    add_flag_table(p.add_argument_group("Megatron's flags with no effect on this backend (a note in the log), or "
                                        "refused with the reason (docs/training.md#megatrons-flags)"),
                   MEGATRON_FLAG_FATES)


def build_rank_parser() -> argparse.ArgumentParser:
    """The parser of `torchrun -m specc_cli.rank` (one rank, launched by hand)."""
    p = _RankParser(prog="python -m specc_cli.rank",
                    description="Train a compiled spec (run under torchrun, one process per rank).")
    add_train_arguments(p, launcher=False)
    return p


class _RankParser(ArgumentParser):
    """The rank's parser prints its one-line error itself: no `specc main` around it."""

    def parse_args(self, args=None, namespace=None):
        try:
            return super().parse_args(args, namespace)
        except (SpecError, UsageError) as e:  # SpecError: the spec's megatron: block
            print(e.format(), file=sys.stderr)
            raise SystemExit(2) from None
