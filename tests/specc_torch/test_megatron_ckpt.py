"""Megatron Core checkpoints in and out (specc_torch/megatron_ckpt), against checkpoints real
Megatron Core 0.19.2 wrote at TP=2 and the logits it computed from them
(tests/fixtures/megatron/make_fixture.py; Megatron is not needed here):

- the torch_dist and the legacy checkpoints load into llama.yaml (GQA: 4 heads in 2 query
  groups, SwiGLU, a vocabulary Megatron padded from 100 to 128) and gpt.yaml (LayerNorm and
  biases, learned positions, the tied output layer) and give Megatron's logits at TP=1, and
  the Llama one at TP=2 with SP through a converted specc checkpoint;
- export then import gives back Megatron's own tensors bit for bit, with its layer stacking;
- a spec that does not fit the checkpoint is one line naming the tensor (and the padded vocabulary);
- the legacy loader runs nothing that a pickle names outside its allow-list;
- a Llama saved at TP=2 x PP=2 (llama_pp2: 4 layers, 2 per stage) and a Mixtral-style MoE saved at
  TP=2 (mixtral: 4 SwiGLU experts, top-2, Megatron's local experts) give Megatron's loss at TP=1 and
  at TP=2 with SP, from both formats; the Mixtral export gives back Megatron's tensors and objects.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

import runtime
import specc_torch
from runtime.checkpoint import load_checkpoint
from specc_torch.megatron_ckpt import MegatronError, export_megatron, import_megatron, read_weights
from specc_torch.megatron_ckpt.files import dist_tensors, read_dist, read_legacy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron")
FIXTURE = os.path.join(FIXTURES, "llama")
SPEC = os.path.join(ROOT, "specs", "llama-tiny.yaml")
# make_fixture.FAMILIES as the specs' config; vocab_size is Megatron's padded one
SIZES = {"hidden_size": 16, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 24,
         "vocab_size": 128, "seq_length": 8}
FAMILIES = {"llama": (SPEC, SIZES),
            "gpt": (os.path.join(ROOT, "specs", "gpt-tiny.yaml"),
                    {"hidden_size": 16, "num_attention_heads": 2, "vocab_size": 64, "seq_length": 8})}
# the fixtures saved by other layouts / structures: (spec, sizes); make_fixture.FAMILIES
LAYOUTS = {
    "llama_pp2": (SPEC, {**SIZES, "vocab_size": 64, "num_layers": 4}),
    "mixtral": (os.path.join(ROOT, "specs", "mixtral-tiny.yaml"),
                {**SIZES, "ffn_hidden_size": 8, "vocab_size": 64, "num_layers": 2, "num_experts": 4,
                 "moe_router_topk": 2}),
}
# fp32 logits of size ~5 through 2 layers of 16-64-term dot products: rounding differences of
# a few ulps per op (Megatron's and specc's op orders differ) stay far below 1e-4
TOL = 1e-4


def _expected(family: str = "llama"):
    return torch.load(os.path.join(FIXTURES, family, "logits.pt"))


def _logits(model, pg, tokens) -> torch.Tensor:
    """[b, s, vocab]: the output layer's vocab shards, captured and gathered over TP."""
    captured = []
    handle = model.output_layer.register_forward_hook(lambda m, i, out: captured.append(out.detach()))
    model.eval()
    with torch.no_grad():
        model(tokens, tokens)
    handle.remove()
    local = captured[0].float().contiguous()
    if pg.tp.size > 1:
        pieces = [torch.empty_like(local) for _ in range(pg.tp.size)]
        dist.all_gather(pieces, local, group=pg.tp.group)
        local = torch.cat(pieces, dim=-1)
    return local.transpose(0, 1)


def _load_and_run(rank, world, ckpt, tokens, spec=SPEC, sizes=SIZES, labels=None):
    pg = runtime.ProcessGroups.initialize(tp=world)
    try:
        model = specc_torch.build_model(spec, pg, seed=3, sp=True, overrides=sizes, micro_batch_size=1)
        load_checkpoint(ckpt, model, pg)
        if labels is None:
            return _logits(model, pg, tokens)
        with torch.no_grad():
            return _logits(model, pg, tokens), model(tokens, labels)
    finally:
        pg.destroy()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return abs(a.mean().item() - b.mean().item()) / abs(b.mean().item())


def test_megatron_checkpoints_give_megatrons_logits(gloo, tmp_path):
    for family, (spec, sizes) in FAMILIES.items():
        expected = _expected(family)
        pg = runtime.ProcessGroups.single()
        model = specc_torch.build_model(spec, pg, seed=3, overrides=sizes, micro_batch_size=1)
        tensors = {}
        for fmt in ("torch_dist", "torch"):
            read = read_weights(os.path.join(FIXTURES, family, fmt), spec, sizes)
            assert (read["format"], read["iteration"], read["optimizer"]) == (fmt, 7, False)
            tensors[fmt] = read["tensors"]
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(read["tensors"][name])
            difference = (_logits(model, pg, expected["tokens"]) - expected["logits"]).abs().max().item()
            assert difference < TOL, (family, fmt, difference)
        # the legacy TP shards, joined, are the global tensors torch_dist holds
        assert all(torch.equal(t, tensors["torch_dist"][n]) for n, t in tensors["torch"].items())
    # converted to a specc checkpoint, it loads at TP=2 with SP and gives the same logits
    expected = _expected()
    done = import_megatron(os.path.join(FIXTURE, "torch_dist"), SPEC, str(tmp_path / "ckpt"), SIZES)
    assert done["step"] == 7
    for logits in gloo.run(2, _load_and_run, str(tmp_path / "ckpt"), expected["tokens"]):
        assert (logits - expected["logits"]).abs().max().item() < TOL


def test_export_then_import_is_bit_exact(tmp_path):
    import_megatron(os.path.join(FIXTURE, "torch_dist"), SPEC, str(tmp_path / "ckpt"), SIZES)
    done = export_megatron(str(tmp_path / "ckpt"), SPEC, str(tmp_path / "megatron"), SIZES)
    assert done["path"] == str(tmp_path / "megatron" / "iter_0000007")
    with open(tmp_path / "megatron" / "latest_checkpointed_iteration.txt") as f:
        assert f.read() == "7"
    theirs = dist_tensors(os.path.join(FIXTURE, "torch_dist", "iter_0000007"))
    ours = dist_tensors(done["path"])
    # the same stacked keys (decoder.layers.X: [layers, ...]) and objects Megatron's load asks for
    assert set(theirs.pop(None)) == set(ours.pop(None))
    assert {v[0] for v in theirs.values()} == {v[0] for v in ours.values()}
    a, b = read_dist(os.path.join(FIXTURE, "torch_dist", "iter_0000007"), theirs), read_dist(done["path"], ours)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    again = read_weights(str(tmp_path / "megatron"), SPEC, SIZES)["tensors"]
    first = read_weights(os.path.join(FIXTURE, "torch_dist"), SPEC, SIZES)["tensors"]
    assert all(torch.equal(again[n], first[n]) for n in first)


def _error(*args, **kwargs) -> str:
    with pytest.raises(MegatronError) as e:
        read_weights(*args, **kwargs)
    line = str(e.value)
    assert "\n" not in line
    return line


def test_a_spec_that_does_not_fit_is_one_line():
    where = os.path.join(FIXTURE, "torch_dist", "iter_0000007")
    # the tokenizer's unpadded vocabulary: the hint gives Megatron's padded size
    assert _error(os.path.join(FIXTURE, "torch_dist"), SPEC, {**SIZES, "vocab_size": 100}) == (
        f"{where}: embedding.word_embeddings.weight is [128, 16] in the checkpoint, but spec llama_tiny's "
        "embedding.weight is [100, 16] (Megatron pads the vocabulary to a multiple of "
        "--make-vocab-size-divisible-by x TP: --set vocab_size=128)")
    # 4 query groups where Megatron saved 2: the fused QKV rows do not add up
    assert _error(os.path.join(FIXTURE, "torch"), SPEC, {**SIZES, "num_query_groups": 4}) == (
        f"{os.path.join(FIXTURE, 'torch', 'iter_0000007')}: decoder.layers.0.self_attention.linear_qkv.weight is "
        "[32, 16] in the checkpoint, but spec llama_tiny's layers.0.self_attention.linear_qkv.weight is [48, 16] "
        "(4 query groups of 12 rows)")
    assert _error(where, SPEC, {**SIZES, "num_layers": 3}) == (
        f"{where}: no tensor decoder.layers.2.self_attention.linear_qkv.layer_norm_weight (for llama_tiny's "
        "layers.2.input_norm.weight)")
    assert _error(os.path.dirname(FIXTURE), SPEC, SIZES) == (
        f"{os.path.dirname(FIXTURE)}: not a Megatron checkpoint (no latest_checkpointed_iteration.txt, no iter_*/ "
        "with its files)")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ["SPECC_EXPLOIT_MARK"],))


def test_the_legacy_loader_runs_nothing_outside_its_allow_list(tmp_path, monkeypatch):
    mark = tmp_path / "ran"
    monkeypatch.setenv("SPECC_EXPLOIT_MARK", str(mark))
    rank = tmp_path / "iter_0000001" / "mp_rank_00"
    rank.mkdir(parents=True)
    weight = torch.arange(6.0).reshape(2, 3)
    torch.save({"args": _Exploit(), "iteration": 1, "model": {"decoder.final_layernorm.weight": weight}},
               rank / "model_optim_rng.pt", pickle_protocol=pickle.HIGHEST_PROTOCOL)
    shards, optimizer = read_legacy(str(tmp_path / "iter_0000001"))
    assert not mark.exists() and not optimizer
    assert torch.equal(shards[(0, 0)]["decoder.final_layernorm.weight"], weight)


def test_legacy_pipeline_stages_are_renumbered(tmp_path):
    """Megatron's legacy TP=2 files cut into PP=2 stages as its training loop saves them
    (mp_rank_TT_PPP, each stage numbering its layers from 0, with optimizer state): the same
    weights as the TP-only files, and the optimizer state reported, not read."""
    from specc_torch.megatron_ckpt.files import LEGACY_FILE, safe_torch_load

    source = os.path.join(FIXTURE, "torch", "iter_0000007")
    for tp in (0, 1):
        state = safe_torch_load(os.path.join(source, f"mp_rank_{tp:02d}", LEGACY_FILE))
        for pp in (0, 1):
            model = {}
            for name, t in state["model"].items():
                if name.startswith(f"decoder.layers.{pp}."):
                    model[name.replace(f"decoder.layers.{pp}.", "decoder.layers.0.")] = t
                elif (pp == 0) == name.startswith("embedding."):
                    model[name] = t
            folder = tmp_path / "iter_0000007" / f"mp_rank_{tp:02d}_{pp:03d}"
            folder.mkdir(parents=True)
            torch.save({"model": model, "iteration": 7, "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}},
                       folder / LEGACY_FILE)
    staged = read_weights(str(tmp_path / "iter_0000007"), SPEC, SIZES)
    assert staged["optimizer"] and staged["iteration"] == 7
    whole = read_weights(os.path.join(FIXTURE, "torch"), SPEC, SIZES)["tensors"]
    assert staged["tensors"].keys() == whole.keys()
    assert all(torch.equal(staged["tensors"][n], whole[n]) for n in whole)


# The mean per-token loss, Megatron's and specc's, in fp32 over 8 tokens: the logits agree to a few
# ulps (< 1e-5 absolute at ~5), so the losses agree to ~1e-6 relative; the issue asks 1e-5.
LOSS_RTOL = 1e-5


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_other_layouts_give_megatrons_loss(gloo, tmp_path, family):
    """llama_pp2: Megatron's PP=2 stages (torch_dist: the layer stacks at their global offsets;
    legacy: mp_rank_TT_PPP, each stage numbering its 2 layers from 0); mixtral: the router and
    the local experts (torch_dist: mlp.experts.experts.X over [layers, experts]; legacy:
    local_experts.E per TP rank, [gate_r | up_r] each)."""
    spec, sizes = LAYOUTS[family]
    expected = _expected(family)
    pg = runtime.ProcessGroups.single()
    model = specc_torch.build_model(spec, pg, seed=3, overrides=sizes, micro_batch_size=1)
    tensors = {}
    for fmt in ("torch_dist", "torch"):
        read = read_weights(os.path.join(FIXTURES, family, fmt), spec, sizes)
        tensors[fmt] = read["tensors"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(read["tensors"][name])
            loss = model(expected["tokens"], expected["labels"])
        assert (_logits(model, pg, expected["tokens"]) - expected["logits"]).abs().max().item() < TOL, fmt
        assert loss.shape == expected["loss"].shape
        assert (loss - expected["loss"]).abs().max().item() < TOL and _relative(loss, expected["loss"]) < LOSS_RTOL
    assert all(torch.equal(t, tensors["torch_dist"][n]) for n, t in tensors["torch"].items())
    import_megatron(os.path.join(FIXTURES, family, "torch_dist"), spec, str(tmp_path / "ckpt"), sizes)
    for logits, loss in gloo.run(2, _load_and_run, str(tmp_path / "ckpt"), expected["tokens"], spec, sizes,
                                 expected["labels"]):
        assert (logits - expected["logits"]).abs().max().item() < TOL
        assert _relative(loss, expected["loss"]) < LOSS_RTOL


def test_moe_export_then_import_is_bit_exact(tmp_path):
    """The Mixtral export holds Megatron's stacked expert tensors and one _extra_state object per
    layer and expert (shard_L.E_layers.experts), the keys its dist_checkpointing.load asks for."""
    spec, sizes = LAYOUTS["mixtral"]
    source = os.path.join(FIXTURES, "mixtral", "torch_dist")
    import_megatron(source, spec, str(tmp_path / "ckpt"), sizes)
    done = export_megatron(str(tmp_path / "ckpt"), spec, str(tmp_path / "megatron"), sizes)
    theirs, ours = dist_tensors(os.path.join(source, "iter_0000007")), dist_tensors(done["path"])
    assert set(theirs.pop(None)) == set(ours.pop(None))
    assert {v[0] for v in theirs.values()} == {v[0] for v in ours.values()}
    a, b = read_dist(os.path.join(source, "iter_0000007"), theirs), read_dist(done["path"], ours)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_expert_parallel_legacy_files_are_refused_in_one_line(tmp_path):
    """EP with PP names a rank's folder mp_rank_TT_PPP_EEE; EP without PP mp_rank_TT_EEE, as PP
    alone does (Megatron's get_checkpoint_name), which the saved args tell apart."""
    import argparse

    rank = tmp_path / "iter_0000001" / "mp_rank_00_000_001"
    rank.mkdir(parents=True)
    torch.save({"model": {}}, rank / "model_optim_rng.pt")
    line = _error(str(tmp_path / "iter_0000001"), *LAYOUTS["mixtral"])
    assert line == f"{tmp_path / 'iter_0000001'}: expert-parallel legacy checkpoints (mp_rank_TT_PPP_EEE) are not read"
    for ep in (0, 1):  # TP=1, EP=2: what Megatron 0.19.2 wrote at TP=2 x EP=2 with expert TP 1, as folders go
        rank = tmp_path / "iter_0000002" / f"mp_rank_00_{ep:03d}"
        rank.mkdir(parents=True)
        args = argparse.Namespace(expert_model_parallel_size=2, pipeline_model_parallel_size=1)
        torch.save({"args": args, "model": {}}, rank / "model_optim_rng.pt")
    line = _error(str(tmp_path / "iter_0000002"), *LAYOUTS["mixtral"])
    assert line == (f"{tmp_path / 'iter_0000002'}: expert-parallel legacy checkpoints (saved with "
                    "--expert-model-parallel-size 2: mp_rank_TT[_PPP]_EEE) are not read")


def _save_and_convert(rank, world, save_dir):
    from types import SimpleNamespace

    from runtime.checkpoint import save_checkpoint
    from runtime.train.config import OptimizerConfig
    from specc_torch.megatron_ckpt.train import megatron_save

    pg = runtime.ProcessGroups.initialize(tp=world)
    try:
        model = specc_torch.build_model(SPEC, pg, seed=3, sp=True, overrides=SIZES, micro_batch_size=1)
        save_checkpoint(save_dir, 5, model, pg)
        cfg = SimpleNamespace(spec=SPEC, overrides=SIZES, data=SimpleNamespace(padded_vocab_size=None),
                              checkpoint=SimpleNamespace(save=save_dir, keep_last=None), optimizer=OptimizerConfig())
        return megatron_save(cfg, 5, rank, world)
    finally:
        pg.destroy()


def test_a_run_at_tp2_saves_megatrons_checkpoint_beside_its_own(gloo, tmp_path):
    """--ckpt-format torch_dist's save at TP=2 (the checkpoint's read is collective: every rank
    takes part, rank 0 writes): Megatron's iter_0000005/ beside specc's step_0000005/, the same
    weights bit for bit."""
    from runtime.checkpoint import read_tensors

    save = str(tmp_path / "save")
    written = os.path.join(save, "iter_0000005")  # (a checkpoint without optimizer state: the weights)
    assert gloo.run(2, _save_and_convert, save) == [f"{written} (weights only: the checkpoint has no optimizer state)"] * 2
    ours, megatron = read_tensors(save), read_weights(save, SPEC, SIZES)
    assert megatron["iteration"] == 5 and ours.keys() == megatron["tensors"].keys()
    assert all(torch.equal(ours[n], megatron["tensors"][n]) for n in ours)


# -- optimizer state ---------------------------------------------------------------------------------
# llama_optim: Megatron's own DDP and Adam (fp32, not distributed; lr 1e-2, betas (0.9, 0.95), weight
# decay 0.1 on matrices) trained 3 steps at TP=2 and saved model + optimizer (torch_dist/iter_0000003);
# then it took step 4 on batch.pt's batch and saved the model (after/iter_0000004).
OPTIM_FIXTURE = os.path.join(FIXTURES, "llama_optim")
OPTIM_SIZES = {**SIZES, "vocab_size": 64}
# One Adam step from the same weights and moments: the gradients differ by fp32 rounding (~1e-6
# relative), which moves the update lr * m/sqrt(v) by ~lr * 1e-6; the weights (|w| < 2) round to
# 2.4e-7. 1e-6 is above both; a moment mapped wrong (or a fresh optimizer) moves the weights by ~lr.
STEP_TOL = 1e-6


def _specc_step(rank, world, ckpt, batch, with_optimizer, out_dir):
    """specc's own step 4 from the imported checkpoint at TP=world (SP): its DDP, finalize and Adam
    with Megatron's settings; saves the model (step 4) in out_dir."""
    from runtime.checkpoint import adam_state, restore_adam, save_checkpoint
    from runtime.optim import Adam

    pg = runtime.ProcessGroups.initialize(tp=world) if world > 1 else runtime.ProcessGroups.single()
    try:
        model = specc_torch.build_model(SPEC, pg, seed=3, sp=world > 1, overrides=OPTIM_SIZES, micro_batch_size=1)
        ddp = runtime.DistributedDataParallel(model, pg)
        o = batch["optim"]
        opt = Adam(ddp, pg, weight_decay=o["weight_decay"], beta1=o["adam_beta1"], beta2=o["adam_beta2"],
                   eps=o["adam_eps"], clip_grad=0.0)
        if with_optimizer:
            out = load_checkpoint(ckpt, model, pg, optimizer_state=adam_state(opt, model))
            restore_adam(opt, out["optimizer_state"])
        else:
            load_checkpoint(ckpt, model, pg)
        step = opt.step_count
        ddp.zero_grad_buffer()
        model.train()
        loss = model(batch["tokens"], batch["labels"]).mean()
        loss.backward()
        runtime.finalize_model_grads(model, pg, ddp)
        opt.step(o["lr"])
        save_checkpoint(out_dir, 4, model, pg)
        return step, loss.item()
    finally:
        pg.destroy()


def test_megatron_optimizer_state_continues_megatrons_training(gloo, tmp_path):
    """Megatron's Adam state (exp_avg, exp_avg_sq through the same name and fused-QKV row
    mapping as the weights, the step count, the data position) comes over: specc's step 4 from it,
    at TP=1 and at TP=2 with SP, gives Megatron's own step-4 weights; a fresh optimizer does not."""
    from runtime.checkpoint import read_info, read_tensors

    batch = torch.load(os.path.join(OPTIM_FIXTURE, "batch.pt"))
    done = import_megatron(os.path.join(OPTIM_FIXTURE, "torch_dist"), SPEC, str(tmp_path / "ckpt"), OPTIM_SIZES)
    assert (done["step"], done["optimizer_step"], done["data"]) == (3, 3, {"consumed_samples": 6})
    assert done["optimizer_state"] == ["exp_avg", "exp_avg_sq", "master"]
    assert read_info(done["path"])["config"]["optimizer"]["adam_beta2"] == 0.95
    megatron = read_weights(os.path.join(OPTIM_FIXTURE, "after"), SPEC, OPTIM_SIZES)["tensors"]

    def worst(out_dir):
        ours = read_tensors(out_dir)
        return max((ours[n] - megatron[n]).abs().max().item() for n in megatron)

    assert _specc_step(0, 1, str(tmp_path / "ckpt"), batch, True, str(tmp_path / "tp1")) == pytest.approx(
        (3, batch["loss"]), rel=1e-6)
    assert worst(str(tmp_path / "tp1")) < STEP_TOL
    for step, loss in gloo.run(2, _specc_step, str(tmp_path / "ckpt"), batch, True, str(tmp_path / "tp2")):
        assert step == 3 and loss == pytest.approx(batch["loss"], rel=1e-6)
    assert worst(str(tmp_path / "tp2")) < STEP_TOL
    _specc_step(0, 1, str(tmp_path / "ckpt"), batch, False, str(tmp_path / "fresh"))
    assert worst(str(tmp_path / "fresh")) > 1e-3


def test_the_distributed_optimizers_model_space_layout_is_read(tmp_path):
    """llama_distopt: the same 3 steps under Megatron's distributed optimizer, saved with
    --dist-ckpt-optim-fully-reshardable (optimizer.state.param/exp_avg/exp_avg_sq.X at the model's
    shapes, the step in the param_groups): specc's step 4 from it gives Megatron's step 4 too."""
    from runtime.checkpoint import read_tensors

    batch = torch.load(os.path.join(OPTIM_FIXTURE, "batch.pt"))
    done = import_megatron(os.path.join(FIXTURES, "llama_distopt", "torch_dist"), SPEC, str(tmp_path / "ckpt"),
                           OPTIM_SIZES)
    assert (done["optimizer_step"], done["optimizer_state"]) == (3, ["exp_avg", "exp_avg_sq", "master"])
    _specc_step(0, 1, str(tmp_path / "ckpt"), batch, True, str(tmp_path / "out"))
    ours, megatron = read_tensors(str(tmp_path / "out")), read_weights(os.path.join(OPTIM_FIXTURE, "after"), SPEC,
                                                                       OPTIM_SIZES)["tensors"]
    assert max((ours[n] - megatron[n]).abs().max().item() for n in megatron) < STEP_TOL


def test_optimizer_export_then_import_is_bit_exact(tmp_path):
    """The export writes the Adam state as Megatron's non-distributed optimizer saved it: the same
    stacked optimizer.state.exp_avg(_sq).X tensors bit for bit, and the common state's step and
    param_groups (which Megatron's load pairs with its own groups) equal to Megatron's."""
    from specc_torch.megatron_ckpt.files import read_common

    source = os.path.join(OPTIM_FIXTURE, "torch_dist", "iter_0000003")
    import_megatron(os.path.join(OPTIM_FIXTURE, "torch_dist"), SPEC, str(tmp_path / "ckpt"), OPTIM_SIZES)
    done = export_megatron(str(tmp_path / "ckpt"), SPEC, str(tmp_path / "megatron"), OPTIM_SIZES)
    assert done["optimizer"] == "Adam state at step 3 (exp_avg, exp_avg_sq)"
    theirs, ours = dist_tensors(source), dist_tensors(done["path"])
    assert set(theirs.pop(None)) == set(ours.pop(None))
    assert {v[0] for v in theirs.values()} == {v[0] for v in ours.values()}
    assert sum(k.startswith("optimizer.state.exp_avg_sq.") for k in ours) == 15
    a, b = read_dist(source, theirs), read_dist(done["path"], ours)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    mine, megatron = read_common(done["path"]), read_common(source)
    assert mine["optimizer"]["param_groups"] == megatron["optimizer"]["param_groups"]
    assert torch.equal(mine["optimizer"]["state"]["common_step"], megatron["optimizer"]["state"]["common_step"])
    assert mine["content_metadata"] == megatron["content_metadata"]


def test_optimizer_layouts_not_read_are_refused_in_one_line(tmp_path):
    """The distributed optimizer's per-DP-rank layouts (dp_reshardable, Megatron 0.19's default:
    the common state below is what its save writes) and a legacy checkpoint's optimizer state are
    refused naming the way out; a checkpoint without optimizer state needs --no-load-optim or
    --finetune, as in Megatron."""
    from types import SimpleNamespace

    from specc_torch.hf.convert import model_params
    from specc_torch.megatron_ckpt.convert import megatron_tensors
    from specc_torch.megatron_ckpt.files import write_dist
    from specc_torch.megatron_ckpt.train import megatron_load_rules

    weights = read_weights(os.path.join(OPTIM_FIXTURE, "torch_dist"), SPEC, OPTIM_SIZES)["tensors"]
    spec, _identity, params = model_params(SPEC, OPTIM_SIZES)
    tensors, modules = megatron_tensors(weights, SPEC, spec, params)
    written = write_dist(str(tmp_path / "dp"), 3, tensors, modules, {
        "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"},
        "optimizer": {"param_state_sharding_type": "dp_reshardable"}})
    line = _error(str(tmp_path / "dp"), SPEC, OPTIM_SIZES, optimizer_state=True)
    assert line == (f"{written}: its optimizer state is Megatron's distributed optimizer in the 'dp_reshardable' "
                    "layout (flat buffers per data-parallel rank), which is not read: load with --no-load-optim (or "
                    "--finetune), or save it from Megatron with --dist-ckpt-optim-fully-reshardable")

    def rules(load, finetune=False, no_load_optim=False):
        return megatron_load_rules(SimpleNamespace(checkpoint=SimpleNamespace(
            load=load, finetune=finetune, no_load_optim=no_load_optim)))

    assert rules(str(tmp_path / "dp")) == [f"--load {tmp_path / 'dp'}: {line}"]
    assert rules(str(tmp_path / "dp"), no_load_optim=True) == [
        f"--load {tmp_path / 'dp'}: its args hold no consumed_train_samples (the data position to resume from): add "
        "--finetune to start from its weights at iteration 0"]
    assert rules(str(tmp_path / "dp"), finetune=True) == []
    assert rules(os.path.join(FIXTURE, "torch_dist")) == [
        f"--load {os.path.join(FIXTURE, 'torch_dist')}: a Megatron Core checkpoint without optimizer state: add "
        "--no-load-optim (its weights, iteration and data position, a fresh optimizer) or --finetune (its weights "
        "only)"]
    assert rules(os.path.join(OPTIM_FIXTURE, "torch_dist"), no_load_optim=True) == []
    assert rules(os.path.join(FIXTURE, "torch")) == [
        f"--load {os.path.join(FIXTURE, 'torch')}: from Megatron's legacy torch format only the weights are read (not "
        "its optimizer state, iteration or data position): add --finetune (or save it with --ckpt-format torch_dist)"]
    assert rules(os.path.join(OPTIM_FIXTURE, "torch_dist")) == []
