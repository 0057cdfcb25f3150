"""Training-step time of specc's compiled GPT against Megatron Core, the system users would
otherwise pick, measured side by side in one run at TP=1, TP=2 and TP=2 with SP:

  specc          gpt.yaml compiled for the setting (runtime.finalize_model_grads after backward)
  megatron       Megatron Core 0.19.2's GPTModel with its local (non-TE) layer spec: the same GPT-2
                 architecture (learned positions, LayerNorm, tanh GELU, biases, tied output),
                 Megatron's own SP layer-norm gradient all-reduce after backward
  specc+compile  (with --torch-compile) specc with each layer compiled (runtime.compile_layers)
  specc-gloo     (TP > 1) specc with its collectives on gloo (transport "torch"), as Megatron's
                 are; "specc" uses the default transport, shared memory where every rank has a
                 core (runtime/cpu/shared_memory.py)
  specc-own      specc's own training step: runtime.DistributedDataParallel, finalize_model_grads
                 and runtime.optim.Adam (flat buffers, torch's fused AdamW kernel)
  megatron-own   Megatron Core's own: its DistributedDataParallel, finalize_model_grads and
                 get_megatron_optimizer (torch's foreach AdamW on the CPU, under FP32Optimizer)

Both sides start from the same weights (specc's TP-invariant init, gathered to full size and cut
the way Megatron shards: vocabulary rows, per-head [q_h|k_h|v_h] QKV rows, column and row
splits) and their first losses are compared. A step is zero_grad, forward, backward, gradient
finalization, torch.optim.AdamW(fused=True) (the same optimizer on both sides, torch's fastest on
the CPU); the implementations alternate step by step and the median is
taken, over --rounds independent rounds of --steps steps; the ratio reported is the median of
the per-round ratios. MFU is the model's FLOPs per step (from specc's plan: the compiler counts
every op) over a measured fp32 GEMM peak at the same thread count (one per rank), read among
each round's steps and taken per round. Each rank keeps the host memory a step frees
(runtime.cpu.host_memory, as `specc train` does), which speeds both sides alike. At TP=2 it
also times specc's collectives alone and inside the step (runtime.comm.CommTimer): the fraction
of collective time the step hides.

Megatron Core is never a dependency of specc: `bench/setup_megatron.sh` installs it into
bench/.megatron (what it needs on the CPU is explained there and in cpu_patches below).

    bash bench/setup_megatron.sh
    python bench/megatron_step.py [--rounds 5 --steps 6] [--torch-compile] [--settings tp1,tp2,tp2sp] [--load N]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import subprocess
import sys
import time
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON = os.path.join(ROOT, "bench", ".megatron")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from benchdoc import replace_section  # noqa: E402
from megatron_step_report import COMM, DOC, LABELS, OWN, SETTINGS, TITLE, comm_table, table, transports  # noqa: E402
from train_step import (  # noqa: E402
    Runner,
    compiled_loss,
    gemm_peak_gflops,
    machine_line,
    make_batches,
    measure,
    overrides,
    plan_flops,
    plan_flops_by_kind,
    run_ranks,
)

import runtime  # noqa: E402
import specc_torch  # noqa: E402
from runtime.compile import compile_layers  # noqa: E402
from runtime.init import full_parameter  # noqa: E402
from runtime.optim import Adam  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "gpt.yaml")


# -- Megatron Core on the CPU ----------------------------------------------------------------------

def cpu_patches() -> None:
    """What Megatron Core needs to run on the CPU: its tensors are created on
    torch.cuda.current_device(), and its RNG tracker saves and restores CUDA generator states
    (routed to the CPU generator; with dropout 0 no mask is drawn)."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Its DistributedDataParallel and optimizer (the "own training step" rows) create small state
    # tensors with device="cuda" and order work on CUDA streams: tensors on the CPU, no-op streams.
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.Stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None


def _on_cpu(factory):
    def make(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return factory(*args, device=device, **kwargs)
    return make


class _NoStream:
    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


def sequence_parallel_layer_norm():
    """Megatron's torch LayerNorm refuses sequence parallelism (its fused ones need Apex/TE): the
    same nn.LayerNorm with its parameters tagged `sequence_parallel`, which Megatron's
    finalize_model_grads all-reduces over TP, plugged in through the layer spec."""

    class SequenceParallelLayerNorm(torch.nn.LayerNorm):
        def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
            super().__init__(hidden_size, eps=eps)
            for p in self.parameters():
                p.sequence_parallel = config.sequence_parallel

    return SequenceParallelLayerNorm


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def build_megatron(cfg, tp: int, sp: bool):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():  # one model per kind of step: built twice
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    config = TransformerConfig(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads, ffn_hidden_size=4 * cfg.hidden,
        tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, bf16=False, fp16=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, layernorm_epsilon=1e-5,
        activation_func=_gelu_tanh)  # gpt.yaml's MLP: GPT-2's tanh GELU (gelu_new)
    spec = get_gpt_layer_local_spec()
    if sp:
        import megatron.core.transformer.transformer_block as block

        norm = sequence_parallel_layer_norm()
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        block.LayerNormImpl = norm  # the final layer norm of the block
    model = GPTModel(config, spec, vocab_size=cfg.vocab, max_sequence_length=cfg.seq,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    model.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)  # read by its finalize helper
    return model, config


def copy_weights(megatron_model, full: dict, heads: int, tp: int, rank: int) -> None:
    """Megatron's shards of specc's full weights: vocabulary rows, per-head [q_h|k_h|v_h] QKV
    rows (Megatron's fused layout) cut by heads, fc1 rows, proj/fc2 columns."""
    def rows(t):
        return t.chunk(tp, dim=0)[rank]

    def cols(t):
        return t.chunk(tp, dim=1)[rank]

    def per_head(t):  # [Q | K | V] slabs -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
        q, k, v = (x.reshape(heads, -1, *t.shape[1:]) for x in t.chunk(3, dim=0))
        return torch.stack([q, k, v], dim=1).reshape(t.shape)

    target = {"embedding.word_embeddings.weight": rows(full["embedding.weight"]),
              "embedding.position_embeddings.weight": full["position_embedding.weight"],
              "decoder.final_layernorm.weight": full["final_layernorm.weight"],
              "decoder.final_layernorm.bias": full["final_layernorm.bias"]}
    layers = {n.split(".")[1] for n in full if n.startswith("layers.")}
    for i in sorted(layers, key=int):
        s, m = f"layers.{i}.", f"decoder.layers.{i}."
        for norm_s, norm_m in (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "pre_mlp_layernorm")):
            for p in ("weight", "bias"):
                target[m + f"{norm_m}.{p}"] = full[s + f"{norm_s}.{p}"]
        target[m + "self_attention.linear_qkv.weight"] = rows(per_head(full[s + "self_attention.linear_qkv.weight"]))
        target[m + "self_attention.linear_qkv.bias"] = rows(per_head(full[s + "self_attention.linear_qkv.bias"]))
        target[m + "self_attention.linear_proj.weight"] = cols(full[s + "self_attention.linear_proj.weight"])
        target[m + "self_attention.linear_proj.bias"] = full[s + "self_attention.linear_proj.bias"]
        target[m + "mlp.linear_fc1.weight"] = rows(full[s + "mlp.linear_fc1.weight"])
        target[m + "mlp.linear_fc1.bias"] = rows(full[s + "mlp.linear_fc1.bias"])
        target[m + "mlp.linear_fc2.weight"] = cols(full[s + "mlp.linear_fc2.weight"])
        target[m + "mlp.linear_fc2.bias"] = full[s + "mlp.linear_fc2.bias"]
    params = dict(megatron_model.named_parameters())
    missing = sorted(set(params) ^ set(target))
    if missing:
        raise RuntimeError(f"weight mapping does not cover Megatron's parameters: {missing[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(target[name])


def megatron_loss_fn(seq: int):
    positions = torch.arange(seq).unsqueeze(0)
    causal = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)  # explicit: with none it builds one on CUDA

    def loss(model, batch):
        tokens, labels = batch
        return model(tokens, positions.expand(tokens.shape[0], -1), causal, labels=labels).mean()

    return loss


class OwnStepRunner(Runner):
    """A training step as each system's own training loop runs it: its data-parallel wrapper with
    flat gradient buffers, its gradient finalization and its optimizer (AdamW, weight decay 0.01
    on matrices, no clipping on either side). `setup(model)` returns (wrapped model, zero_grad,
    finalize, optimizer_step)."""

    def __init__(self, name, model, step_loss, setup):
        super().__init__(name, model, step_loss)
        self.wrapped, self.zero_grad, self.finalize, self.optimizer_step = setup(model)

    def step(self, batch, measure_memory=False):
        start = time.perf_counter()
        self.zero_grad()
        loss = self.step_loss(self.wrapped, batch)
        loss.backward()
        self.finalize()
        self.optimizer_step()
        elapsed = time.perf_counter() - start
        self.losses.append(float(loss.detach()))
        return elapsed


def specc_own_step(pg):
    """specc's training step (runtime/train/training.py): runtime.DistributedDataParallel, then
    runtime.finalize_model_grads, then runtime.optim.Adam over the flat buffers (fused kernel)."""
    def setup(model):
        ddp = runtime.DistributedDataParallel(model, pg)
        opt = Adam(ddp, pg, weight_decay=0.01, clip_grad=0.0)
        return ddp, ddp.zero_grad_buffer, lambda: runtime.finalize_model_grads(model, pg, ddp), lambda: opt.step(1e-4)
    return setup


def megatron_own_step(mconfig):
    """Megatron Core's training step (megatron/training's train_step): its DistributedDataParallel,
    finalize_model_grads and get_megatron_optimizer; without TE or Apex that is torch's AdamW
    (foreach) under its FP32Optimizer, which copies main_grad into grad first."""
    def setup(model):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallel(mconfig, DistributedDataParallelConfig(), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, clip_grad=0.0,
                                                     bf16=False, fp16=False), [ddp])

        def zero_grad():
            ddp.zero_grad_buffer()
            opt.zero_grad()
        return ddp, zero_grad, lambda: finalize_model_grads([ddp]), opt.step
    return setup


def collective_time(runner, batches, steps: int = 3) -> dict:
    """How much of specc's collective time the step hides: per step, the time this rank waits on
    its collectives inside the step (runtime.comm.CommTimer: blocking calls, and the wait() of the
    async ones overlapped with GEMMs) against the same collectives issued alone."""
    exposed, alone = [], []
    for i in range(steps):
        with runtime.comm.CommTimer() as timer:
            runner.step(batches[i % len(batches)])
        exposed.append(timer.exposed_seconds())
        alone.append(timer.replay())
    return {"count": len(timer.records), "bytes": sum(r.bytes for r, _, _ in timer.records),
            "exposed": statistics.median(exposed), "alone": statistics.median(alone)}


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def matmul_time(runner, batches, steps: int = 4) -> dict:
    """Where a step's time goes (torch.profiler, per step): the whole step, the self time of the
    matrix multiplies, of attention's fused kernels (whose FLOPs the plan also counts) and of the
    optimizer step; against the median of GEMM peak readings taken between the profiled steps,
    since this machine's speed drifts (by 10% and more within a run)."""
    from torch.profiler import ProfilerActivity, profile

    peaks, total, gemm, attention, optimizer = [gemm_peak_gflops()], 0.0, 0.0, 0.0, 0.0
    for i in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            total += runner.step(batches[i % len(batches)])
        peaks.append(gemm_peak_gflops())
        events = prof.key_averages()
        gemm += sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
        attention += sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
        optimizer += sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#"))
    return {"step": total / steps, "gemm": gemm / 1e6 / steps, "attention": attention / 1e6 / steps,
            "optimizer": optimizer / 1e6 / steps, "peak_gflops": statistics.median(peaks)}


def matmul_line(res: dict, flops: float, attention_flops: float) -> str:
    """What bounds TP=1's MFU, as an exact sum: MFU = (share of the step in GEMMs) x (their rate
    over the peak) + the same for attention's kernels, so what it lacks of 100% is the GEMMs' and
    attention's shortfall from the peak, plus the optimizer's share and everything else's (norms,
    GELU, residual adds, the loss, the embedding), which do no counted FLOPs."""
    t = res["matmul"]
    peak = t["peak_gflops"] * 1e9
    shares = {k: t[k] / t["step"] for k in ("gemm", "attention", "optimizer")}
    rest = 1 - sum(shares.values())
    gemm_rate = (flops - attention_flops) / t["gemm"] / peak
    attention_rate = attention_flops / t["attention"] / peak if t["attention"] else 0.0
    util = shares["gemm"] * gemm_rate + shares["attention"] * attention_rate
    return (f"- **What bounds MFU at TP=1** (specc's step under torch.profiler, repeated on its own rather than "
            f"alternating with the other runners as in the table, against the GEMM peak read between the profiled "
            f"steps, {t['peak_gflops']:.1f} GFLOP/s): matrix multiplies take {shares['gemm']:.0%} of the step and run "
            f"at {gemm_rate:.0%} of the peak; attention's fused kernels take {shares['attention']:.0%} and run at "
            f"{attention_rate:.0%} of it; so MFU is {util:.0%}. The rest of the step does no counted FLOPs: the "
            f"optimizer {shares['optimizer']:.0%}, everything else (norms, GELU, residual adds, the loss, the "
            f"embedding) {rest:.0%}.")


# -- one setting on its ranks ----------------------------------------------------------------------

def _rank(rank, world, cfg, setting):
    sys.path.insert(0, MEGATRON)
    cpu_patches()
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    tp, sp = SETTINGS[setting]
    pg = runtime.ProcessGroups.initialize(tp=tp)  # the default transport: shared memory where it can
    ours = specc_torch.build_model(SPEC, pg, seed=cfg.seed, sp=sp, overrides=overrides(cfg),
                                   micro_batch_size=cfg.batch)
    full = {n: full_parameter(p, pg.tp) for n, p in ours.named_parameters()}
    theirs, mconfig = build_megatron(cfg, tp, sp)
    copy_weights(theirs, full, cfg.heads, tp, pg.tp.rank)
    runners = [Runner("specc", ours, compiled_loss, lambda: runtime.finalize_model_grads(ours, pg), fused_adamw=True),
               Runner("megatron", theirs, megatron_loss_fn(cfg.seq),
                      lambda: _allreduce_non_tensor_model_parallel_grads([theirs], mconfig), fused_adamw=True)]
    groups = [pg]
    if tp > 1:  # specc on Megatron's transport: what the shared-memory collectives are worth
        on_gloo = runtime.ProcessGroups.initialize(tp=tp, transport="torch")
        groups.append(on_gloo)
        specc_gloo = specc_torch.build_model(SPEC, on_gloo, seed=cfg.seed, sp=sp, overrides=overrides(cfg),
                                             micro_batch_size=cfg.batch)
        runners.append(Runner("specc-gloo", specc_gloo, compiled_loss,
                              lambda: runtime.finalize_model_grads(specc_gloo, on_gloo), fused_adamw=True))
    if cfg.own_step:  # second copies of both models (the steps change the weights)
        ours2 = specc_torch.build_model(SPEC, pg, seed=cfg.seed, sp=sp, overrides=overrides(cfg),
                                        micro_batch_size=cfg.batch)
        theirs2, _ = build_megatron(cfg, tp, sp)
        copy_weights(theirs2, full, cfg.heads, tp, pg.tp.rank)
        runners += [OwnStepRunner("specc-own", ours2, compiled_loss, specc_own_step(pg)),
                    OwnStepRunner("megatron-own", theirs2, megatron_loss_fn(cfg.seq), megatron_own_step(mconfig))]
    if cfg.torch_compile:
        compiled = specc_torch.build_model(SPEC, pg, seed=cfg.seed, sp=sp, overrides=overrides(cfg),
                                           micro_batch_size=cfg.batch)
        compile_layers(compiled, "inductor")
        runners.append(Runner("specc+compile", compiled, compiled_loss,
                              lambda: runtime.finalize_model_grads(compiled, pg), fused_adamw=True))
    batches = make_batches(cfg)
    rounds, peaks = [], []
    for _ in range(cfg.rounds):
        for r in runners:
            r.times.clear()
        # the GEMM peak of a round: the median of short readings taken among its steps, so that
        # the machine's drift (10% and more over a run) moves the steps and their peak together
        readings: list[float] = []
        rounds.append(measure(runners, batches, cfg.steps, between=lambda: readings.append(gemm_peak_gflops(repeats=2))))
        peaks.append(statistics.median(readings))
    comm_time = None
    named = {r.name: r for r in runners}
    if tp > 1:
        comm_time = {name: collective_time(named[name], batches) for name in ("specc", "specc-gloo")}
    transport = "shared memory" if pg.tp.transport is not None else "gloo"
    matmul = matmul_time(named["specc"], batches) if tp == 1 else None
    for g in groups:
        g.destroy()
    return {"rounds": rounds, "peaks": peaks, "comm": comm_time, "transport": transport, "matmul": matmul}


def run_setting(cfg, setting: str) -> dict:
    tp, _ = SETTINGS[setting]
    got = run_ranks(_rank, tp, cfg, setting, what=setting, timeout_s=600)
    # a step ends when every rank's does: the slower rank's median per round
    rounds = [{n: max(got[r]["rounds"][k][n][0] for r in got) for n in got[0]["rounds"][k]}
              for k in range(cfg.rounds)]
    first = {n: got[0]["rounds"][0][n][2] for n in got[0]["rounds"][0]}
    comm_time = None
    if got[0]["comm"] is not None:  # per runner, the rank that waited longest: it sets the step's end
        comm_time = {name: max((got[r]["comm"][name] for r in got), key=lambda c: c["exposed"])
                     for name in got[0]["comm"]}
    # every rank has its own core: what the ranks could do meanwhile is the sum of their peaks
    peaks = [statistics.mean(got[r]["peaks"][k] for r in got) for k in range(cfg.rounds)]
    return {"rounds": rounds, "first_loss": first, "peaks": peaks,
            "comm": comm_time, "transport": got[0]["transport"], "matmul": got[0]["matmul"]}


@contextlib.contextmanager
def background_load(processes: int):
    """`processes` busy loops running for the duration (yielded): other work on a shared machine."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield spinners
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--steps", type=int, default=6, help="timed steps per implementation per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--settings", default="tp1,tp2,tp2sp")
    p.add_argument("--torch-compile", action="store_true", help="also time specc with each layer compiled")
    p.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="N other processes spin on the CPU throughout (busy loops): how both systems hold up on "
                        "a shared machine; written to a section of its own")
    p.add_argument("--no-own-step", dest="own_step", action="store_false",
                   help="time only the model step (the same torch AdamW on both sides), not also each "
                        "system's own training step (its DDP and optimizer)")
    cfg = p.parse_args(argv)
    settings = cfg.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {', '.join(unknown)} (known: {', '.join(SETTINGS)})")
    if not os.path.isdir(os.path.join(MEGATRON, "megatron", "core")):
        print("error: Megatron Core is not installed for the benchmark: run `bash bench/setup_megatron.sh`",
              file=sys.stderr)
        return 2
    shape = (f"gpt.yaml at hidden {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads, seq {cfg.seq}, vocab "
             f"{cfg.vocab}, micro-batch {cfg.batch}, fp32; {cfg.rounds} rounds of {cfg.steps} timed steps each "
             f"after 2 warm-up steps")
    if cfg.load < 0:
        p.error("--load: a number of processes, 0 or more")
    print(f"bench/megatron_step.py: {shape}", flush=True)
    start = time.perf_counter()
    torch.set_num_threads(1)
    flops = plan_flops(cfg)
    results = {}
    with background_load(cfg.load):
        for setting in settings:
            results[setting] = run_setting(cfg, setting)
            print(f"{LABELS[setting]} done", flush=True)
    elapsed = time.perf_counter() - start
    text = table(cfg, results, flops)
    print(text)
    collectives = comm_table(results)
    if collectives:
        collectives = COMM.format(table=collectives)
        print(collectives)
    attention_flops = plan_flops_by_kind(cfg).get("core_attention", 0.0)
    matmul = "".join(matmul_line(res, flops, attention_flops) + "\n" for res in results.values() if res["matmul"])
    if matmul:
        print(matmul)
    own = ""
    if cfg.own_step:
        own = OWN.format(table=table(cfg, results, flops, "specc-own", "megatron-own"))
        print(own)
    for setting, res in results.items():
        for ours, theirs in (("specc", "megatron"), ("specc-gloo", "megatron"), ("specc-own", "megatron-own")):
            if ours not in res["first_loss"]:
                continue
            a, b = res["first_loss"][ours], res["first_loss"][theirs]
            if abs(a - b) > 1e-3 * abs(b):
                print(f"error: {setting}: first losses differ ({ours} {a} vs {theirs} {b}): not the same model",
                      file=sys.stderr)
                return 1
    if not cfg.no_write:
        peak = statistics.median(x for res in results.values() for x in res["peaks"])
        title, load, args = TITLE, "", " --torch-compile" if cfg.torch_compile else ""
        if cfg.load:
            processes = f"{cfg.load} busy process{'es' if cfg.load > 1 else ''}"
            title += f", with {processes} alongside"
            load = (f" Throughout, {processes} (a Python `while True: pass` each) spun on the CPU, so the ranks "
                    f"shared its cores with them: how both systems hold up on a loaded machine.")
            args += f" --load {cfg.load}"
        section = DOC.format(title=title, args=args, load=load, date=datetime.date.today().isoformat(),
                             machine=machine_line(), elapsed=elapsed, shape=shape, flops=flops, peak=peak, table=text,
                             own=own, comm=collectives, rounds=cfg.rounds, transport=transports(results),
                             matmul=matmul)
        replace_section(cfg.output, section)
        print(f"wrote {cfg.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
