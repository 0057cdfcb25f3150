"""Megatron's training options: SGD as torch computes it; fp16's dynamic loss scaling (an inf on
one rank skips the step on every rank, the scale backs off after the hysteresis); the distributed
optimizer's parameter all-gather overlapped with the next forward; WSD, warmup fraction and
sample-based schedules; --exit-interval, --no-load-optim and --finetune in the real loop; and
the rules checked before anything starts."""

from __future__ import annotations

import io
import json
import math
import os

import pytest
import torch
from train_helpers import make_corpus, tiny_config

from runtime.ddp import DistributedDataParallel
from runtime.grads import finalize_model_grads
from runtime.optim import SGD, Adam, DynamicGradScaler, LRSchedule
from runtime.parallel_state import ProcessGroups
from runtime.train.config import OptimizerConfig, ScheduleConfig, TrainConfig, lr_step, resolve, schedule_steps


def _toy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def test_sgd_matches_torch_sgd():
    ours, theirs = _toy(), _toy()
    with torch.no_grad():  # norm gains and biases away from 1 and 0
        for p in list(ours.parameters()) + list(theirs.parameters()):
            if p.dim() == 1:
                p.add_(0.3)
    ddp = DistributedDataParallel(ours, ProcessGroups.single(), bucket_size=20)
    opt = SGD(ddp, ProcessGroups.single(), weight_decay=0.1, momentum=0.8)
    decay = [p for p in theirs.parameters() if p.dim() > 1]
    no_decay = [p for p in theirs.parameters() if p.dim() <= 1]
    ref = torch.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=0.1, momentum=0.8)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(4, 6, generator=g)
        lr = 0.05 * (step + 1)
        ddp.zero_grad_buffer()
        ddp(x).pow(2).mean().backward()
        finalize_model_grads(ours, ProcessGroups.single(), ddp)
        assert opt.step(lr)[1]
        ref.zero_grad()
        theirs(x).pow(2).mean().backward()
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        # the same formula in the same order up to one fused multiply-add: a few float32 ulps
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=4 * 2.0 ** -24, atol=4 * 2.0 ** -24)
    assert opt.state_bytes() == opt.replicated_state_bytes() == ddp.numel * 4  # one momentum buffer


def test_dynamic_loss_scale_backs_off_after_the_hysteresis_and_grows_after_the_window():
    s = DynamicGradScaler(initial_scale=2.0 ** 10, min_scale=2.0 ** 8, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0 ** 10  # the first overflow is tolerated
    s.update(True)
    assert s.scale == 2.0 ** 9
    s.update(True)
    assert s.scale == 2.0 ** 8  # the hysteresis stays used up until the scale grows again
    s.update(True)
    assert s.scale == 2.0 ** 8  # never below min_scale
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0 ** 9 and s.hysteresis_tracker == 2
    s.update(False)
    s.update(True)
    assert (s.scale, s.growth_tracker) == (2.0 ** 9, 0)  # an overflow restarts the window


def _fp16_and_param_gather(rank, world):
    """On 2 DP ranks with the distributed optimizer (each rank steps its own shard): fp16 loss
    scaling with an inf injected into rank 1's shard only; then the parameter all-gather
    overlapped with the next forward against the blocking one."""
    pg = ProcessGroups.initialize(tp=1)
    try:
        out = {}
        torch.manual_seed(0)
        model = _toy().half()
        ddp = DistributedDataParallel(model, pg, bucket_size=30, grad_reduce="reduce_scatter")
        scaler = DynamicGradScaler(initial_scale=2.0 ** 12, hysteresis=1)
        opt = Adam(ddp, pg, distributed=True, grad_scaler=scaler)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)).half()
        before = [p.detach().clone() for p in model.parameters()]
        ddp.zero_grad_buffer()
        (ddp(x).float().pow(2).mean() * scaler.scale).backward()
        finalize_model_grads(model, pg, ddp)
        if rank == 1:
            opt.ranges[0].grad[0] = float("inf")
        norm, applied = opt.step(1e-2)
        out["skipped"] = (not applied, opt.step_count, scaler.scale)
        out["unchanged"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        ddp.zero_grad_buffer()
        (ddp(x).float().pow(2).mean() * scaler.scale).backward()
        finalize_model_grads(model, pg, ddp)
        out["applied"] = opt.step(1e-2)[1] and not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

        weights = {}
        for overlap in (False, True):
            torch.manual_seed(0)
            model = _toy()
            ddp = DistributedDataParallel(model, pg, bucket_size=30, grad_reduce="reduce_scatter")
            opt = Adam(ddp, pg, distributed=True, overlap_param_gather=overlap)
            pending = []
            for step in range(3):
                ddp.zero_grad_buffer()
                ddp(x.float() + step).pow(2).mean().backward()
                pending.append(ddp.param_gather_pending())  # what the forward left pending: nothing
                finalize_model_grads(model, pg, ddp)
                opt.step(1e-2)
                pending.append(ddp.param_gather_pending())  # after the step: every bucket, with overlap
            ddp.finish_param_sync()
            weights[overlap] = ([p.detach().clone() for p in model.parameters()], pending, len(ddp.buckets))
        out["gather"] = weights
        first = next(m for m in model.modules() if list(m.parameters(recurse=False)))
        out["order"] = (ddp.forward_order, {ddp._bucket_of[p].index for p in first.parameters(recurse=False)})
        return out
    finally:
        pg.destroy()


def test_fp16_inf_skips_on_every_rank_and_overlapped_param_gather_matches(gloo):
    results = gloo.run(2, _fp16_and_param_gather)
    for out in results:
        assert out["skipped"] == (True, 0, 2.0 ** 11)  # skipped on both ranks, the scale halved
        assert out["unchanged"] and out["applied"]
        (plain, plain_pending, buckets), (overlapped, pending, _) = out["gather"][False], out["gather"][True]
        assert buckets > 1 and plain_pending == [[]] * 6
        assert pending == [[], list(range(buckets))] * 3  # each step's gathers wait for the next forward
        # the gathers start in the order the forward needs them: the first module's parameters
        # sit in the last buckets (buckets follow backward's order) and are gathered first
        order, first = out["order"]
        assert sorted(order) == list(range(buckets)) and set(order[:len(first)]) == first
        assert buckets - 1 in first and order != list(range(buckets))
        for a, b in zip(plain, overlapped):
            assert torch.equal(a, b)  # the same collectives, only later
    assert all(torch.equal(a, b) for a, b in zip(results[0]["gather"][True][0], results[1]["gather"][True][0]))


def _cfg(**kw) -> TrainConfig:
    sched = {k: kw.pop(k) for k in list(kw) if k.startswith("lr_")}
    opt = {k: kw.pop(k) for k in ("optimizer", "sgd_momentum", "overlap_param_gather") if k in kw}
    cfg = TrainConfig(spec="x.yaml", schedule=ScheduleConfig(**sched), optimizer=OptimizerConfig(lr=1.0, **opt), **kw)
    return cfg


def test_wsd_warmup_fraction_and_sample_based_schedules():
    # WSD: constant until the last 20 of 100 steps, then Megatron's four decay shapes to min_lr
    for style, half in (("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5 ** 0.5 - 1),
                        ("minus_sqrt", 1 - 0.5 ** 0.5)):
        wsd = LRSchedule(1.0, 0.1, 10, 100, "WSD", 20, style)
        assert [wsd(i) for i in (5, 11, 80)] == pytest.approx([0.5, 1.0, 1.0])
        assert wsd(90) == pytest.approx(0.1 + 0.9 * half) and wsd(100) == wsd(150) == pytest.approx(0.1)
    cfg = _cfg(train_iters=50, lr_decay_style="WSD", lr_wsd_decay_iters=10, lr_warmup_fraction=0.1)
    assert resolve(cfg, 1) == [] and schedule_steps(cfg) == (5.0, 50, 10)
    # --train-samples: iterations = samples // global batch, and the schedule counts samples
    cfg = _cfg(train_iters=None, train_samples=100, global_batch_size=8, lr_warmup_samples=16,
               lr_decay_samples=80)
    assert resolve(cfg, 2) == [] and cfg.train_iters == 12 and cfg.num_micro_batches == 4
    assert schedule_steps(cfg) == (16, 80, 0) and lr_step(cfg, 3) == 24
    assert resolve(cfg, 2) == [] and cfg.train_iters == 12  # the ranks resolve the launcher's config again
    cfg = _cfg(train_iters=None, train_samples=100, global_batch_size=8, lr_warmup_fraction=0.25)
    assert resolve(cfg, 1) == [] and schedule_steps(cfg) == (25.0, 100, 0)


@pytest.mark.parametrize("kw,error", [
    (dict(train_iters=10, train_samples=100, global_batch_size=4), "give one of --train-iters and --train-samples"),
    (dict(train_iters=None), "give --train-iters N or --train-samples N"),
    (dict(train_iters=None, train_samples=3, global_batch_size=4), "--train-samples 3 is less than one global "
     "batch (4)"),
    (dict(train_iters=None, train_samples=64, lr_warmup_iters=5), "--lr-warmup-iters count iters, but the run is "
     "given in samples (--train-samples): use --lr-warmup-samples"),
    (dict(lr_decay_style="WSD"), "--lr-decay-style WSD needs --lr-wsd-decay-iters N (the length of its final decay)"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=200), "--lr-wsd-decay-iters 200 exceeds the decay iters after "
     "warmup (100)"),
    (dict(lr_warmup_fraction=0.2, lr_warmup_iters=3), "give one of --lr-warmup-fraction and --lr-warmup-iters"),
    (dict(lr_warmup_fraction=1.5), "--lr-warmup-fraction must be in [0, 1], got 1.5"),
    (dict(optimizer="sgd", sgd_momentum=1.0), "--sgd-momentum must be in [0, 1), got 1.0"),
    (dict(overlap_param_gather=True), "--overlap-param-gather needs --use-distributed-optimizer"),
    (dict(bf16=True, fp16=True), "give one of --bf16 and --fp16"),
    (dict(exit_interval=0), "--exit-interval must be at least 1, got 0"),
    (dict(host_memory="keep"), "--host-memory must be retain or release, got 'keep'"),
])
def test_training_option_rules(kw, error):
    errors = resolve(_cfg(**kw), 1)
    assert len(errors) == 1 and errors[0].startswith(error), errors
    cfg = _cfg()
    cfg.checkpoint.finetune = True
    assert resolve(cfg, 1) == ["--finetune needs --load DIR"]


@pytest.mark.parametrize("files,flags", [(dict(vocab_file="v.json", merge_file="m.txt"), "--vocab-file and --merge-file"),
                                         (dict(tokenizer_model="t.model"), "--tokenizer-model")])
def test_tokenizer_files_without_a_type_are_an_error_not_ignored(files, flags):
    cfg = _cfg()
    for key, value in files.items():
        setattr(cfg.data, key, value)
    (error,) = resolve(cfg, 1)
    assert error.startswith(f"{flags} without --tokenizer-type: say which tokenizer reads ")


def test_megatrons_habits_carry_on_with_a_note_as_megatron_does():
    """--sequence-parallel at TP=1 (Megatron warns and turns it off) and --no-load-optim without
    --load (nothing to load) are notes for the run's log, not errors; each said once, however
    often the rules run (the launcher and every rank resolve the same config)."""
    cfg = _cfg()
    cfg.parallel.sp, cfg.checkpoint.no_load_optim = True, True
    assert resolve(cfg, 1) == [] and resolve(cfg, 1) == []
    assert cfg.parallel.sp is False
    assert cfg.notes == ["--sequence-parallel at --tensor-model-parallel-size 1: sequence parallelism is off (it "
                         "shards the sequence over the tensor-parallel ranks), as Megatron turns it off",
                         "--no-load-optim without --load: no effect (nothing is loaded)"]
    assert "notes" in cfg.to_dict()  # they travel to the ranks with the rest of the config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("options")))


def _run(data, run_dir, **kw):
    from specc_torch.train import run

    ckpt = {k: kw.pop(k) for k in ("save", "load", "no_load_optim", "finetune") if k in kw}
    optimizer = kw.pop("optimizer", "adam")
    cfg = tiny_config(1, data, mbs=2, gbs=2, eval_iters=0, **kw)
    cfg.optimizer.optimizer = optimizer
    cfg.logging.run_dir, cfg.logging.progress = run_dir, False
    for key, value in ckpt.items():
        setattr(cfg.checkpoint, key, value)
    out = io.StringIO()
    assert run(cfg, stream=out) == 0
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return records, out.getvalue()


def test_fp16_exit_interval_no_load_optim_and_finetune_in_the_loop(corpus, tmp_path):
    from runtime.checkpoint import complete_steps

    ckpt = str(tmp_path / "ckpt")
    records, log = _run(corpus, str(tmp_path / "a"), train_iters=6, exit_interval=2, save=ckpt, fp16=True,
                        optimizer="sgd")
    assert [r["iteration"] for r in records] == [1, 2] and complete_steps(ckpt) == [2]  # exited, saved
    assert "exiting after iteration 2 (--exit-interval 2)" in log and "dynamic loss scale from 4.29497e+09" in log
    assert all(r["skipped"] for r in records)  # 2**32 overflows fp16: skipped until the scale backs off
    records, log = _run(corpus, str(tmp_path / "b"), train_iters=4, load=ckpt, no_load_optim=True)
    assert [r["iteration"] for r in records] == [3, 4] and "without its optimizer state (--no-load-optim)" in log
    assert records[0]["consumed_samples"] == 6  # the data position continues
    records, log = _run(corpus, str(tmp_path / "c"), train_iters=2, load=ckpt, finetune=True)
    assert [r["iteration"] for r in records] == [1, 2] and "(--finetune): training starts at iteration 0" in log
    assert not any(r["skipped"] for r in records) and all(math.isfinite(r["loss"]) for r in records)


def test_megatrons_training_flags_reach_the_config():
    from specc_cli.main import build_parser
    from specc_cli.train_config import config_from_args

    spec = os.path.join(os.path.dirname(__file__), "..", "..", "..", "specs", "gpt-tiny.yaml")
    args = build_parser().parse_args(
        ["train", spec, "--fp16", "--initial-loss-scale", "65536", "--min-loss-scale", "2", "--loss-scale-window",
         "100", "--hysteresis", "3", "--train-samples", "640", "--lr-warmup-fraction", "0.05", "--lr-decay-style",
         "WSD", "--lr-wsd-decay-style", "cosine", "--lr-wsd-decay-samples", "128", "--exit-interval", "7",
         "--optimizer", "sgd", "--sgd-momentum", "0.8", "--use-distributed-optimizer", "--overlap-param-gather",
         "--load", "ckpt", "--no-load-optim", "--finetune", "--log-throughput"])
    cfg = config_from_args(args)
    assert cfg.optimizer.overlap_grad_reduce is True  # the default
    for flags, overlap in ((["--overlap-grad-reduce"], True), (["--no-overlap-grad-reduce"], False)):
        assert config_from_args(build_parser().parse_args(["train", spec, *flags])).optimizer.overlap_grad_reduce \
            is overlap  # Megatron's flag is accepted: it asks for specc's default
    assert (cfg.fp16, cfg.loss_scale.initial_loss_scale, cfg.loss_scale.min_loss_scale) == (True, 65536, 2)
    assert (cfg.loss_scale.loss_scale_window, cfg.loss_scale.hysteresis, cfg.loss_scale.loss_scale) == (100, 3, None)
    assert (cfg.train_iters, cfg.train_samples, cfg.exit_interval) == (None, 640, 7)
    s = cfg.schedule
    assert (s.lr_warmup_fraction, s.lr_decay_style, s.lr_wsd_decay_style, s.lr_wsd_decay_samples) == (
        0.05, "WSD", "cosine", 128)
    o = cfg.optimizer
    assert (o.optimizer, o.sgd_momentum, o.overlap_param_gather) == ("sgd", 0.8, True)
    assert cfg.checkpoint.no_load_optim and cfg.checkpoint.finetune and cfg.logging.log_throughput
    assert resolve(cfg, 2) == [] and cfg.train_iters == 320  # 640 samples of global batch 2
    assert config_from_args(build_parser().parse_args(["train", spec])).train_iters == 100  # the default without either


def test_the_plan_says_its_dtype_and_train_compiles_at_the_dtype_it_runs():
    from specc.compiler import load_and_compile
    from specc.frontend.model import Settings
    from specc.plan import build_plan, plan_text
    from specc_cli.main import build_parser
    from specc_cli.train_config import config_from_args
    from specc_torch.train_compile import compile_model

    spec = os.path.join(os.path.dirname(__file__), "..", "..", "..", "specs", "gpt-tiny.yaml")
    header = plan_text(build_plan(load_and_compile(spec, Settings())[1])).splitlines()[3]
    assert header == "# bytes at bf16 (--dtype bf16|fp16|fp32); specc train runs at fp32 unless --bf16 or --fp16"
    for flags, dtype in (([], "fp32"), (["--bf16"], "bf16"), (["--fp16"], "fp16")):
        cfg = config_from_args(build_parser().parse_args(["train", spec, *flags]))
        assert compile_model(cfg)[1].settings.dtype == dtype  # the run's plan is sized at its own dtype


def test_expert_parallel_size_rules_are_one_line_each():
    from runtime.train.config import TrainConfig, resolve

    for ep, expected in ((0, "--expert-model-parallel-size must be at least 1, got 0"),
                         (3, "--expert-model-parallel-size 3 must divide the data-parallel size 2")):
        cfg = TrainConfig(spec="specs/gpt-tiny.yaml")
        cfg.parallel.ep = ep
        errors = resolve(cfg, 2)
        assert len(errors) == 1 and errors[0].startswith(expected), errors


def _param_gather_with_experts(rank, world):
    """A mixture of experts at EP 1 over DP 2: the expert weights get buckets of their own (over
    the expert-data-parallel group, here the DP ranks), after the dense ones. The overlapped
    gathers cover them in forward order too, and the weights equal the blocking gather's."""
    import os

    from runtime.init import randomize_parameters
    from runtime.moe import is_expert_param
    from specc_torch.api import build_model

    spec = os.path.join(os.path.dirname(__file__), "..", "..", "..", "specs", "mixtral-tiny.yaml")
    pg = ProcessGroups.initialize(dp=2)
    try:
        gen = torch.Generator().manual_seed(3 + rank)
        tokens, labels = torch.randint(0, 100, (2, 16), generator=gen), torch.randint(0, 100, (2, 16), generator=gen)
        out = {}
        for overlap in (False, True):
            torch.manual_seed(7)  # the same draws in both runs (the router's, dropout's)
            model = build_model(spec, pg, micro_batch_size=2, overrides={"num_layers": 2})
            randomize_parameters(model, 5)
            ddp = DistributedDataParallel(model, pg, bucket_size=4_000, grad_reduce="reduce_scatter")
            opt = Adam(ddp, pg, distributed=True, overlap_param_gather=overlap)
            for _ in range(3):
                ddp.zero_grad_buffer()
                ddp(tokens, labels).mean().backward()
                finalize_model_grads(model, pg, ddp)
                opt.step(1e-2)
            ddp.finish_param_sync()
            experts = sorted({ddp._bucket_of[p].index for p in ddp.params if is_expert_param(p)})
            first = next(m for m in model.modules() if any(p in ddp._bucket_of for p in m.parameters(recurse=False)))
            out[overlap] = ([p.detach().clone() for p in model.parameters()], ddp.forward_order, experts,
                            {ddp._bucket_of[p].index for p in first.parameters(recurse=False)}, len(ddp.buckets))
        return out
    finally:
        pg.destroy()


def test_overlapped_param_gather_orders_and_gathers_expert_buckets(gloo):
    for out in gloo.run(2, _param_gather_with_experts):
        (plain, _, _, _, _), (overlapped, order, experts, first, buckets) = out[False], out[True]
        assert buckets > 2 and experts and max(experts) == buckets - 1  # expert buckets follow the dense ones
        assert sorted(order) == list(range(buckets)) and set(order[:len(first)]) == first
        # the first layer's experts are gathered before the last layer's dense weights (forward order)
        assert order.index(experts[-1]) < order.index(0)
        for a, b in zip(plain, overlapped):
            assert torch.equal(a, b)
