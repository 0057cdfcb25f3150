"""Activation recompute is exact and its memory is what the plan says.

* `specc verify` passes with recompute (full, and selective), against the reference that does not
  recompute: loss, logits, activations, every gradient, the weights after SGD steps and the
  collectives the plan counts (the recompute repeats a region's forward collectives), at TP 1, 2
  with SP and CP 2, with dropout on at TP (TP-invariant masks, so compared exactly).
* With the tracker's own dropout streams (tensor-parallel masks differ per rank), a recomputed
  model gives the same loss and gradients as the same model without recompute: the recompute
  replays the RNG streams, so it drops what the forward dropped.
* The bytes autograd keeps for backward (saved tensors, and the inputs torch's checkpoint holds)
  are the plan's activation_bytes, per configuration, exactly, once the two things the plan
  models as on a GPU are accounted for (below)."""

from __future__ import annotations

import os

import pytest
import torch

import runtime
import runtime.activation_recompute as activation_recompute
from runtime.parallel_state import ProcessGroups
from specc.plan import build_plan
from specc.settings import Settings
from specc_torch import api

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT, LLAMA = os.path.join(ROOT, "specs", "gpt-tiny.yaml"), os.path.join(ROOT, "specs", "llama-tiny.yaml")
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
SELECTIVE = {"recompute_granularity": "selective"}


def _verify(rank, world, cases):
    from specc_torch.verify import VerifyConfig, _verify_all

    out = []
    for spec, overrides, recompute, tps, cps in cases:
        cfg = VerifyConfig(spec=spec, tps=tps, sps=[True], cps=cps, steps=2, overrides=overrides,
                           tp_invariant_dropout=True, recompute=recompute)
        out += _verify_all(rank, cfg)
    return out


def test_recompute_passes_verify_at_tp1_tp2_sp_and_cp2(gloo):
    # with dropout where the TP-invariant masks compare exactly (they are not CP-invariant: at CP 2
    # the streams' replay is checked in test_recompute_replays_the_dropout_streams)
    cases = [(GPT, DROPOUT, FULL, [1, 2], [1]), (GPT, {}, SELECTIVE, [1], [2]),
             (LLAMA, {}, SELECTIVE, [2], [1]), (LLAMA, {}, {**FULL, "recompute_num_layers": 2}, [1], [2])]
    rows = gloo.run(2, _verify, cases)[0]
    bad = [r for r in rows if not r.ok]
    assert not bad, bad
    settings = {r.setting for r in rows}
    assert settings == {"tp=1 sp=off recompute=full/uniform/1", "tp=2 sp=on recompute=full/uniform/1",
                        "tp=1 cp=2 sp=off recompute=selective", "tp=2 sp=on recompute=selective",
                        "tp=1 cp=2 sp=off recompute=full/uniform/2"}, settings
    counted = [r for r in rows if r.quantity == "collectives == plan"]
    assert len(counted) == 5 and all(r.detail != "none" for r in counted[1:])  # tp=1 alone: none
    assert all(r.quantity != "per-token loss with dropout" for r in rows)  # compared exactly, not statistically


def _losses_and_grads(spec, overrides, recompute, pg):
    text, s, _ = api.compile_source(spec, Settings(tp=pg.tp.size, sp=pg.tp.size > 1, cp=pg.cp.size, micro_batch_size=2,
                                                         dtype="fp32", **(recompute or {})), overrides)
    tracker = runtime.RNGTracker(7, pg.tp.rank, cp_rank=pg.cp.rank)  # the streams, not the debug mode
    model = api.load_module_from_source(text, s.name).build_model(pg, seed=3, rng_tracker=tracker)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(2):  # two steps: the recompute must not shift the streams of the next one
        tokens = torch.randint(0, 256, (2, 32), generator=g)
        loss = model(tokens, torch.roll(tokens, -1, 1))
        loss.mean().backward()
        out.append((loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    return out


def _replay(rank, world):
    results = []
    for tp, cp, spec, recompute in ((2, 1, GPT, FULL), (2, 1, GPT, SELECTIVE), (1, 2, GPT, SELECTIVE),
                                    (2, 1, LLAMA, {**FULL, "recompute_method": "block"})):
        pg = ProcessGroups.initialize(tp=tp, cp=cp)
        try:
            overrides = {**DROPOUT, "vocab_size": 256} if spec == GPT else {"vocab_size": 256}
            if spec == LLAMA:  # llama-tiny has no dropout of its own: add some to the attention core
                overrides["modules.SelfAttention.submodules.core_attention.dropout"] = 0.1
            plain = _losses_and_grads(spec, overrides, None, pg)
            again = _losses_and_grads(spec, overrides, recompute, pg)
            worst = 0.0
            for (loss_a, grads_a), (loss_b, grads_b) in zip(plain, again):
                worst = max(worst, (loss_a - loss_b).abs().max().item())
                for name, grad in grads_a.items():
                    worst = max(worst, (grad - grads_b[name]).abs().max().item())
            results.append((tp, cp, os.path.basename(spec), recompute["recompute_granularity"], worst))
        finally:
            pg.destroy()
    return results


def test_recompute_replays_the_dropout_streams(gloo):
    for tp, cp, spec, granularity, worst in gloo.run(2, _replay)[0]:
        # the same masks and the same arithmetic: equal up to float reassociation in autograd
        assert worst <= 1e-6, (tp, cp, spec, granularity, worst)


# -- memory: the plan's activation bytes against what autograd keeps -----------------------------------

SPEC = os.path.join(ROOT, "specs", "gpt.yaml")
MEMORY = {"vocab_size": 256, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "seq_length": 32, **DROPOUT,
          # the unfused attention keeps its softmax, mask and dropout output: the 5as^2b term
          "modules.SelfAttention.submodules.core_attention.impl": "unfused"}
S, B = 32, 2


def _kept_bytes(recompute):
    """(plan activation bytes, plan per layer), (measured, measured per layer) at fp32."""
    text, spec, graph = api.compile_source(SPEC, Settings(micro_batch_size=B, dtype="fp32", **(recompute or {})), MEMORY)
    plan = build_plan(graph)
    totals, layers = plan.totals["activation_bytes"], dict(plan.totals["activation_bytes_per_layer"])
    for e in plan.entries:
        # the plan's dropout masks are 1 byte an element (a GPU's bool mask); on CPU torch keeps
        # the mask in the input's dtype, 4 bytes here
        extra = 3 * sum(n for key, n in e.saved_items if key.endswith(":mask"))
        totals += extra * e.count
        for name in layers:
            if e.name.startswith(("layers.*.", name + ".")):
                layers[name] += extra
    model = api.load_module_from_source(text, spec.name).build_model(ProcessGroups.single(), seed=1,
                                                                     rng_tracker=runtime.RNGTracker(1, 0))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    names = {id(m): f"layers.{i}" for i, m in enumerate(model.layers)}
    kept, layer = {}, [None]

    def keep(t, where):
        storage = t.untyped_storage()
        # one storage counts once; LayerNorm's per-token mean and rstd ([s, b, 1] fp32), the int64
        # ids and 0-dim scalars are not in the plan (nor in Korthikanti et al.'s count)
        if storage.data_ptr() in params or not t.dtype.is_floating_point or t.dim() == 0 or tuple(t.shape) == (S, B, 1):
            return
        kept.setdefault(storage.data_ptr(), (storage.nbytes(), where))

    for module in model.layers:
        module.register_forward_pre_hook(lambda m, a: layer.__setitem__(0, names[id(m)]))
        module.register_forward_hook(lambda m, a, o: layer.__setitem__(0, None))
    checkpoint = activation_recompute.checkpoint

    def spy(function, *args, **kwargs):  # what torch's checkpoint holds: its inputs, for its (first) layer
        first = getattr(function, "layers", [function])[0]
        for a in args:
            if isinstance(a, torch.Tensor):
                keep(a, names.get(id(first), layer[0]))
        return checkpoint(function, *args, **kwargs)

    tokens = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    activation_recompute.checkpoint = spy
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: keep(t, layer[0]) or t, lambda t: t):
            loss = model(tokens, torch.roll(tokens, -1, 1)).mean()
    finally:
        activation_recompute.checkpoint = checkpoint
    loss.backward()
    per_layer = {}
    for nbytes, where in kept.values():
        if where is not None:
            per_layer[where] = per_layer.get(where, 0) + nbytes
    return (totals, layers), (sum(n for n, _ in kept.values()), per_layer)


@pytest.mark.parametrize("recompute", [None, SELECTIVE, FULL, {**FULL, "recompute_num_layers": 2},
                                       {**FULL, "recompute_method": "block"}],
                         ids=["none", "selective", "full-uniform-1", "full-uniform-2", "full-block-1"])
def test_plan_activation_memory_is_what_autograd_keeps(recompute):
    plan, measured = _kept_bytes(recompute)
    assert measured == plan


def test_recompute_counts_the_routed_tokens_of_a_forward_once():
    """State a forward accumulates (the MoE router's token counts for bias balancing) must not
    count the recompute's second run: the counts, loss and gradients equal those without it."""
    spec = os.path.join(ROOT, "specs", "mixtral-tiny.yaml")
    overrides = {"modules.TransformerLayer.submodules.mlp.expert_bias": True}
    runs = []
    for recompute in (None, FULL):
        text, s, graph = api.compile_source(spec, Settings(micro_batch_size=2, dtype="fp32", **(recompute or {})), overrides)
        model = api.load_module_from_source(text, s.name).build_model(ProcessGroups.single(), seed=3)
        g = torch.Generator().manual_seed(0)
        loss = model(*[torch.randint(0, 64, (2, graph.values[v].shape[1]), generator=g) for v in graph.inputs])
        loss.mean().backward()
        counts = {n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")}
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, counts))  # not the expert bias: it moves by the counts
    (loss_a, grads_a, counts_a), (loss_b, grads_b, counts_b) = runs
    assert counts_a and all(torch.equal(counts_a[n], counts_b[n]) for n in counts_a)
    assert counts_a[next(iter(counts_a))].sum() > 0
    assert torch.allclose(loss_a, loss_b, atol=1e-6) and all(torch.allclose(grads_a[n], grads_b[n], atol=1e-6)
                                                             for n in grads_a)
