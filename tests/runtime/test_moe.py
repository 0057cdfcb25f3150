"""runtime.moe in one process: the MoE layer against a per-token reference written from the
definitions (softmax or sigmoid scores, top-k, renormalization, gated experts, a sigmoid-gated
shared expert), grouped vs looped experts, the auxiliary losses' values and gradients, token
dropping at a capacity factor, and DeepSeek-V3's bias update. (EP/TP: specc verify, and the HF
parity tests at EP=2.)"""

from __future__ import annotations

import math

import pytest
import torch

import runtime
from runtime import Group
from runtime.init import init_parameters, randomize_parameters
from runtime.moe import aux_losses, update_expert_biases

H, E, FF = 16, 4, 12


def layer(**kw):
    kw.setdefault("topk", 2)
    m = runtime.MoELayer(H, E, FF, tp=Group.single("tp"), **kw)
    init_parameters(m, 1)
    randomize_parameters(m, 2)
    return m


def tokens(seed=3, s=6, b=2):
    return torch.randn(s, b, H, generator=torch.Generator().manual_seed(seed))


def reference(m, x, topk, score_function="softmax", renorm=False):
    """Token by token, expert by expert."""
    w1, w2 = m.experts.linear_fc1.weight, m.experts.linear_fc2.weight
    out = []
    for t in x.reshape(-1, H):
        logits = m.router.weight @ t
        scores = logits.softmax(-1) if score_function == "softmax" else logits.sigmoid()
        top = scores.topk(topk).indices
        weights = scores[top] / (scores[top].sum() if renorm else 1.0)
        y = sum(wt * (w2[e] @ runtime.swiglu(w1[e] @ t)) for wt, e in zip(weights, top.tolist()))
        if m.shared_experts is not None:
            s = m.shared_experts
            y = y + torch.sigmoid(s.gate_weight @ t) * (s.linear_fc2.weight @ runtime.swiglu(s.linear_fc1.weight @ t))
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("kw", [{}, {"topk_renorm": True},
                                {"score_function": "sigmoid", "topk_renorm": True, "topk": 3},
                                {"shared_expert_size": 8, "shared_expert_gate": True}])
def test_layer_matches_the_per_token_definition_grouped_and_looped(kw):
    x = tokens()
    ref = None
    for grouped in (True, False):
        m = layer(grouped=grouped, **kw)
        with torch.no_grad():
            y = m(x)
            ref = reference(m, x, kw.get("topk", 2), kw.get("score_function", "softmax"), kw.get("topk_renorm", False))
        assert (y - ref).abs().max().item() < 1e-5


def test_grouped_and_looped_experts_have_the_same_gradients():
    x = tokens()
    grads = []
    for grouped in (True, False):
        m = layer(grouped=grouped, aux_loss_coeff=0.01)
        xg = x.clone().requires_grad_(True)
        m(xg).square().sum().backward()
        grads.append([xg.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 1e-5


def test_auxiliary_losses_follow_their_definitions_and_train_the_router():
    x = tokens()
    coeff, zcoeff = 0.01, 0.001
    m = layer(aux_loss_coeff=coeff, z_loss_coeff=zcoeff)
    m(x)
    losses = aux_losses(m)
    flat = x.reshape(-1, H)
    logits = flat @ m.router.weight.detach().T
    probs = logits.softmax(-1)
    routed = torch.zeros_like(probs).scatter(1, probs.topk(2).indices, 1.0)
    T = flat.shape[0]
    lb = (probs.sum(0) * routed.sum(0)).sum() * E * coeff / (T * T * 2)  # Switch / Megatron's aux_loss
    z = torch.logsumexp(logits, -1).square().mean() * zcoeff
    assert abs(losses["load_balancing_loss"].item() - lb.item()) < 1e-7
    assert abs(losses["z_loss"].item() - z.item()) < 1e-7
    # their gradient reaches the router weight: it differs from the one without them by theirs
    plain = layer()
    plain(x).sum().backward()
    m.zero_grad()
    m(x).sum().backward()
    w = m.router.weight.detach().clone().requires_grad_(True)
    lg = flat @ w.T
    p = lg.softmax(-1)
    extra = (p.sum(0) * routed.sum(0)).sum() * E * coeff / (T * T * 2) + torch.logsumexp(lg, -1).square().mean() * zcoeff
    extra.backward()
    assert (m.router.weight.grad - plain.router.weight.grad - w.grad).abs().max().item() < 1e-6


def test_capacity_factor_drops_the_lowest_scored_tokens_past_capacity():
    x = tokens(s=8)
    m = layer(capacity_factor=0.5)
    T = x.shape[0] * x.shape[1]
    capacity = math.ceil(T * 2 / E * 0.5)
    flat = x.reshape(-1, H)
    with torch.no_grad():
        weights, ids, kept = m.router(flat)
        _, per_expert, _ = m.dispatcher.dispatch(flat, ids, kept)
        assert max(per_expert) <= capacity and sum(per_expert) < T * 2
        scores = (flat @ m.router.weight.T).softmax(-1)
        for e in range(E):  # the kept tokens of an expert score at least as high as its dropped ones
            mine = ids == e
            kept_scores, dropped = scores[:, e][(mine & kept).any(1)], scores[:, e][(mine & ~kept).any(1)]
            if len(dropped):
                assert kept_scores.min() >= dropped.max()
        # a dropped (token, expert) pair contributes nothing: the output is the kept pairs' sum
        y = m(x).reshape(-1, H)
        w1, w2 = m.experts.linear_fc1.weight, m.experts.linear_fc2.weight
        for t in range(T):
            want = sum(weights[t, k] * (w2[e] @ runtime.swiglu(w1[e] @ flat[t]))
                       for k, e in enumerate(ids[t].tolist()) if kept[t, k]) + torch.zeros(H)
            assert (y[t] - want).abs().max().item() < 1e-5


def test_expert_bias_moves_toward_balance_and_steers_selection():
    m = layer(expert_bias=True, expert_bias_update_rate=0.1)
    m.train()
    x = tokens(s=8)
    m(x)
    counts = m.router.tokens_per_expert.clone()
    before = m.router.expert_bias.detach().clone()  # randomized: a parameter (saved, imported), no gradient
    update_expert_biases(m, Group.single("dp"))
    bias = m.router.expert_bias
    assert not bias.requires_grad
    assert torch.equal(bias, before + 0.1 * torch.sign(counts.mean() - counts))
    assert m.router.tokens_per_expert.sum().item() == 0
    # the bias changes which experts are chosen, not the weights they get (scores without bias)
    m.router.expert_bias.fill_(0.0)
    m.router.expert_bias[0] = 10.0
    with torch.no_grad():
        weights, ids, _ = m.router(x.reshape(-1, H))
    assert (ids == 0).any(1).all()
    scores = (x.reshape(-1, H) @ m.router.weight.T).softmax(-1)
    assert torch.allclose(weights, scores.gather(1, ids))


def test_bad_settings_are_errors():
    with pytest.raises(ValueError, match="topk=5"):
        runtime.MoELayer(H, E, FF, topk=5, tp=Group.single("tp"))
    with pytest.raises(ValueError, match="score_function"):
        runtime.MoELayer(H, E, FF, topk=2, tp=Group.single("tp"), score_function="relu")
