"""The loop end to end: a 4-rank TP=2 x DP=2 run follows single-process math and trains; a run
resumed from a checkpoint continues exactly; the rules checked before anything starts; what a
run writes (JSONL, TensorBoard events, the log lines and progress bar)."""

from __future__ import annotations

import io
import json
import math
import os
import platform
import time

import pytest
import torch
from train_helpers import (
    assert_params_close,
    assert_steps_agree,
    distinct_traces,
    make_corpus,
    run_steps,
    tiny_config,
)

from runtime.parallel_state import ProcessGroups
from runtime.train.config import LoggingConfig, OptimizerConfig, ParallelConfig, TrainConfig, resolve
from runtime.train.report import Reporter
from runtime.train.throughput import Peak
from specc_torch.train import run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("loop")))


def _tp2_dp2(rank, world, data):
    pg = ProcessGroups.initialize(tp=2)
    try:
        assert (pg.tp.size, pg.dp.size) == (2, 2)
        cfg = tiny_config(world, data, tp=2, sp=True, dist_opt=True, bucket=25_000)
        assert cfg.num_micro_batches == 2
        trace = {}
        run_steps(cfg, pg, 3, trace=trace)
        return trace
    finally:
        pg.destroy()


def test_tp2_dp2_follows_single_process_math(gloo, corpus):
    cfg = tiny_config(1, corpus)
    for got in distinct_traces(gloo.run(4, _tp2_dp2, corpus)):  # one reference run for identical ranks
        ref = {}
        run_steps(cfg, ProcessGroups.single(), 3, trace=ref, follow=got)
        assert_steps_agree(got, ref, cfg.optimizer, [cfg.optimizer.lr] * 3)


def _float_noise(rel: float, seed: int):
    """on_setup hook: before each optimizer step, every gradient that is float noise (below `rel`
    of its tensor's largest: zero in exact arithmetic, like the key bias's, which softmax ignores)
    is replaced by other noise of that size, as summing it in another order (another machine's
    SIMD kernels) gives."""
    def hook(setup):
        step, gen = setup.optimizer.step, torch.Generator().manual_seed(seed)

        def noisy_step(lr):
            for p in setup.ddp.params:
                lo, hi = setup.ddp.param_range[p]
                g = setup.ddp.grad_buffer[lo:hi]
                scale = rel * g.abs().max()
                noise = (torch.rand(g.shape, generator=gen, dtype=torch.float64) * 2 - 1).float() * scale
                g.copy_(torch.where(g.abs() < scale, noise, g))
            return step(lr)
        setup.optimizer.step = noisy_step
    return hook


def test_steps_compare_from_the_same_weights_as_far_as_float_noise_allows(corpus):
    """Gradients off by float noise move the elements whose gradient is noise by a good part of lr
    under Adam, far beyond the fixed atol that failed on AVX-512 machines; compared step by step
    from the same weights, within Adam's bound, such a run agrees, and a slightly wrong optimizer
    still fails."""
    cfg = tiny_config(1, corpus)
    lrs = [cfg.optimizer.lr] * 3
    single = ProcessGroups.single()
    free = run_steps(cfg, single, 3)[2]
    noisy = {}
    run_steps(cfg, single, 3, trace=noisy, on_setup=_float_noise(1e-6, seed=0))
    with pytest.raises(AssertionError):  # the fixed tolerance this replaced
        assert_params_close(noisy["after"][-1], free)
    ref = {}
    run_steps(cfg, single, 3, trace=ref, follow=noisy)
    assert_steps_agree(noisy, ref, cfg.optimizer, lrs)

    def off_decay(setup):
        setup.optimizer.weight_decay *= 1.1
    wrong = {}
    run_steps(cfg, single, 3, trace=wrong, on_setup=off_decay)
    ref = {}
    run_steps(cfg, single, 3, trace=ref, follow=wrong)
    with pytest.raises(AssertionError, match=r"step 1: .*weight\[\d+\] .* allowed"):
        assert_steps_agree(wrong, ref, cfg.optimizer, lrs)


def _train_run(rank, world, data, run_dir):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        cfg = tiny_config(world, data, tp=2, sp=True, mbs=4, gbs=16, dist_opt=True, lr=5e-3, train_iters=40,
                          eval_interval=20, eval_iters=2)
        cfg.schedule.lr_warmup_iters = 5
        cfg.schedule.lr_decay_style = "cosine"
        cfg.logging.run_dir, cfg.logging.log_interval, cfg.logging.progress = run_dir, 10, False
        cfg.checkpoint.save = os.path.join(run_dir, "ckpt")
        cfg.parallel.dp = 1  # derived again inside run
        cfg.parallel.transport = "shm"  # 4 ranks on fewer cores: "auto" would keep gloo
        log = io.StringIO()
        return run(cfg, stream=log), log.getvalue()
    finally:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)


def test_a_4_rank_tp2_dp2_run_trains(gloo, corpus, tmp_path):
    run_dir = str(tmp_path / "run")
    outcomes = gloo.run(4, _train_run, corpus, run_dir)
    assert [code for code, _ in outcomes] == [0, 0, 0, 0]
    assert "collectives on CPU tensors: tp, dp, edp through shared memory" in outcomes[0][1]
    if platform.libc_ver()[0] == "glibc":  # the default --host-memory retain
        assert "host memory: freed blocks up to 32 MiB stay in the process for the next step" in outcomes[0][1]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["iteration"] for r in train] == list(range(1, 41))
    assert train[-1]["consumed_samples"] == 40 * 16
    first, last = sum(r["loss"] for r in train[:5]) / 5, sum(r["loss"] for r in train[-5:]) / 5
    assert first > 4.5 and last < first - 1.0, (first, last)  # a byte LM starts near ln(256) = 5.55
    assert [e["iteration"] for e in evals] == [20, 40] and evals[1]["loss"] < evals[0]["loss"]
    assert train[0]["lr"] == pytest.approx(1e-3) and train[4]["lr"] == pytest.approx(5e-3)  # warmup
    assert train[-1]["lr"] < train[10]["lr"]  # cosine decay
    saved = json.load(open(os.path.join(run_dir, "config.json")))
    assert saved["train"]["parallel"] == {"tp": 2, "sp": True, "cp": 1, "cp_comm_type": "auto", "pp": 1, "dp": 2, "ep": 1,
                                         "etp": None, "pp_virtual_stage_layers": None, "pp_first_stage_layers": None,
                                         "pp_last_stage_layers": None, "pp_layout": None, "pp_schedule": None,
                                         "transport": "shm"}
    assert saved["model"]["seq_length"] == 32
    # Its final checkpoint loads in one process at TP=1 (resharded) as the same model: the
    # validation loss on the same samples agrees.
    cfg = tiny_config(1, corpus, mbs=4, gbs=16, dist_opt=True, train_iters=40, eval_iters=2)
    cfg.logging.run_dir, cfg.logging.progress = str(tmp_path / "tp1"), False
    cfg.checkpoint.load = os.path.join(run_dir, "ckpt")
    out = io.StringIO()
    assert run(cfg, stream=out) == 0
    assert "resharded" in out.getvalue()
    (again,) = [json.loads(line) for line in open(tmp_path / "tp1" / "metrics.jsonl")]
    assert again["kind"] == "eval" and again["iteration"] == 40
    assert again["loss"] == pytest.approx(evals[1]["loss"], rel=1e-5)


def _single_run(data, run_dir, iters, save=None, load=None, save_interval=None):
    cfg = tiny_config(1, data, mbs=2, gbs=4, train_iters=iters, eval_iters=0)
    cfg.logging.run_dir, cfg.logging.progress = run_dir, False
    cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.save_interval = save, load, save_interval
    assert run(cfg, stream=io.StringIO()) == 0
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_resume_from_a_checkpoint_continues_exactly(corpus, tmp_path):
    from runtime.checkpoint import complete_steps, step_dirname

    ckpt = str(tmp_path / "ckpt")
    full = _single_run(corpus, str(tmp_path / "a"), 6, save=ckpt, save_interval=3)
    assert complete_steps(ckpt) == [3, 6]
    resumed = _single_run(corpus, str(tmp_path / "b"), 6, load=os.path.join(ckpt, step_dirname(3)))
    assert resumed == pytest.approx(full[3:], rel=1e-6)  # iterations 4..6 again, the same


def test_rules_checked_before_anything_starts():
    def errors(world, **kw):
        par = {k: kw.pop(k) for k in ("tp", "cp", "pp") if k in kw}
        opt = {k: kw.pop(k) for k in ("lr",) if k in kw}
        split = kw.pop("split", None)
        cfg = TrainConfig(spec="x.yaml", parallel=ParallelConfig(**par), optimizer=OptimizerConfig(**opt), **kw)
        if split is not None:
            cfg.data.split = split
        return resolve(cfg, world)

    cfg = TrainConfig(spec="x.yaml", parallel=ParallelConfig(tp=2), micro_batch_size=2, global_batch_size=16)
    assert resolve(cfg, 8) == [] and cfg.parallel.dp == 4 and cfg.num_micro_batches == 2
    assert errors(6, tp=4) == ["world size 6 is not divisible by TP*CP*PP = 4*1*1 = 4 (world = TP*CP*DP*PP)"]
    assert errors(4, tp=2, micro_batch_size=2, global_batch_size=6) == [
        "--global-batch-size 6 is not divisible by micro batch * DP = 2*2 = 4 "
        "(global batch = micro batch * DP * accumulation steps)"]
    many = errors(4, pp=2, lr=-1.0, train_iters=0)
    assert len(many) == 3 and all("\n" not in e for e in many)
    # PP=2 needs at least 2 micro-batches in flight; the default global batch gives one per step
    assert any("gives 1 micro-batch(es) per step, fewer than the 2 pipeline stages" in e for e in many)
    cfg = TrainConfig(spec="x.yaml", micro_batch_size=3)
    assert resolve(cfg, 2) == [] and cfg.global_batch_size == 6  # default: no accumulation
    assert errors(1, split="1,2,3,4")[0].startswith("--split 1,2,3,4: expected 2 or 3")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_reporter_writes_jsonl_tensorboard_and_megatron_lines(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, bar = io.StringIO(), _Tty()
    peak = Peak(2.0e-9, "given by --peak-tflops")  # 2000 FLOP/s: at iteration i MFU = (1000 i / 0.5) / 2000 = i
    # Megatron's switches: world-size, validation ppl, timers (iteration-time, throughput) on
    tb = LoggingConfig(log_world_size_to_tensorboard=True, log_validation_ppl_to_tensorboard=True,
                       log_timers_to_tensorboard=True, log_throughput=True)
    rep = Reporter(str(tmp_path), train_iters=4, log_interval=2, stream=out, bar_stream=bar, peak=peak,
                   tensorboard=tb, world_size=8)
    assert rep.progress  # a terminal gets a progress bar
    rep.start({"lr": 0.1}, {"seq_length": 8})
    for it in range(1, 5):
        rep.train(iteration=it, consumed_samples=4 * it, lr=0.1 / it, loss=5.0 - it, grad_norm=1.5, step_time=0.5,
                  tokens=64, batch_size=4, memory_mb=10.0, skipped=False, flops=1000 * it, loss_scale=2.0 ** it)
    rep.evaluation(iteration=4, loss=1.25, consumed_samples=16)
    rep.close()
    lines = out.getvalue().splitlines()
    logs = [ln for ln in lines if "iteration " in ln and "consumed samples" in ln]
    assert len(logs) == 2 and "lm loss: 3.500000E+00" in logs[0] and "tokens per second: 128.0" in logs[0]
    assert "learning rate: 2.500000E-02" in logs[1] and "grad norm: 1.500" in logs[1]
    # TFLOP/s and MFU on every line: the window's mean (step time 0.5 s, 2000 FLOPs at iteration 2)
    assert "throughput per GPU (TFLOP/s/GPU): 4e-09 | MFU: 200.00% |" in logs[0]
    assert "throughput per GPU (TFLOP/s/GPU): 8e-09 | MFU: 400.00% |" in logs[1]
    assert "| loss scale: 4.0 | grad norm: 1.500 |" in logs[0] and "number of nan iterations:   0 |" in logs[0]
    assert any("validation loss at iteration 4 | lm loss value: 1.250000E+00" in ln for ln in lines)
    assert "lm.seq_length" not in out.getvalue() and "model.seq_length" in out.getvalue()
    assert "4/4" in bar.getvalue() and "loss 1.0000" in bar.getvalue()  # tqdm's bar, on the bar stream only
    assert "\r" not in out.getvalue()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["kind"] for r in records] == ["train"] * 4 + ["eval"]
    assert records[3]["tflops_per_rank"] == pytest.approx(8e-9) and records[3]["mfu"] == pytest.approx(4.0)
    # the event files, read back by TensorBoard itself: Megatron's tags, and specc's beside them
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0)]
    assert [(e.step, e.value) for e in acc.Scalars("lm loss validation")] == [(4, 1.25)]
    assert [(e.step, e.value) for e in acc.Scalars("lm loss validation ppl")] == [(4, pytest.approx(math.exp(1.25)))]
    assert [e.value for e in acc.Scalars("learning-rate")] == pytest.approx([0.1, 0.05, 0.1 / 3, 0.025])
    assert [e.value for e in acc.Scalars("loss-scale")] == [2.0, 4.0, 8.0, 16.0]
    assert [e.value for e in acc.Scalars("batch-size")] == [4.0] * 4 and acc.Scalars("world-size")[0].value == 8.0
    assert [(e.step, e.value) for e in acc.Scalars("iteration-time")] == [(2, 0.5), (4, 0.5)]  # at the log lines
    assert [e.value for e in acc.Scalars("throughput")] == pytest.approx([4e-9, 8e-9])  # TFLOP/s per GPU
    assert [e.value for e in acc.Scalars("throughput/mfu")] == pytest.approx([1.0, 2.0, 3.0, 4.0])
    assert {"grad-norm", "throughput/tflops-per-gpu", "memory/max-mb", "step-time"} <= set(acc.Tags()["scalars"])
    samples = EventAccumulator(str(tmp_path / "tensorboard" / "vs-samples"))  # steps: the samples consumed
    samples.Reload()
    assert [(e.step, e.value) for e in samples.Scalars("lm loss vs samples")] == [(4, 4.0), (8, 3.0), (12, 2.0),
                                                                                 (16, 1.0)]
    assert {"learning-rate vs samples", "batch-size vs samples", "loss-scale vs samples", "world-size vs samples",
            "grad-norm vs samples", "lm loss validation vs samples",
            "lm loss validation ppl vs samples"} <= set(samples.Tags()["scalars"])


def test_a_resumed_run_replaces_its_tensorboard_scalars_after_the_checkpoint(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def record(rep, its, base):
        for it in its:
            rep.train(iteration=it, consumed_samples=2 * it, lr=0.1, loss=base - it, grad_norm=1.0, step_time=0.1,
                      tokens=8, batch_size=2, memory_mb=1.0, skipped=False)
        rep.close()

    quiet = dict(stream=io.StringIO(), bar_stream=io.StringIO())
    record(Reporter(str(tmp_path), 4, 2, **quiet), range(1, 5), 5.0)
    # TensorBoard reads a folder's event files in name order: the creation second, host, pid and a
    # per-process counter, which sorts '10' before '9'. A resumed run is a later process; here it is
    # the same one within the same second, so it is given a later second as a restart would have.
    later = time.time() + 60
    monkeypatch.setattr(time, "time", lambda: later)
    resumed = Reporter(str(tmp_path), 4, 2, append=True, **quiet)
    resumed.resume(2, 4)  # from a checkpoint at iteration 2 (4 samples): 3 and 4 again, with other losses
    record(resumed, range(3, 5), 10.0)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(1, 4.0), (2, 3.0), (3, 7.0), (4, 6.0)]
    samples = EventAccumulator(str(tmp_path / "tensorboard" / "vs-samples"))
    samples.Reload()
    assert [(e.step, e.value) for e in samples.Scalars("lm loss vs samples")] == [(2, 4.0), (4, 3.0), (6, 7.0),
                                                                                 (8, 6.0)]
    for folder in ("tensorboard", "tensorboard/vs-samples"):  # no empty file from the writer it replaced
        assert len([f for f in os.listdir(tmp_path / folder) if f.startswith("events.")]) == 2


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path):
    out, bar = io.StringIO(), io.StringIO()
    rep = Reporter(str(tmp_path), train_iters=2, log_interval=1, stream=out, bar_stream=bar)
    assert not rep.progress
    for it in (1, 2):
        rep.train(iteration=it, consumed_samples=it, lr=0.1, loss=1.0, grad_norm=1.0, step_time=0.1, tokens=8,
                  batch_size=1, memory_mb=1.0, skipped=False)
    rep.close()
    assert bar.getvalue() == "" and out.getvalue().count("consumed samples") == 2  # plain lines only
