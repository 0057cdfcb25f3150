import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runtime.init import full_parameter, gather_full, init_parameters, randomize_parameters, stable_seed, tag_parameter
from runtime.layers import (
    ColumnParallelLinear,
    LayerNorm,
    PositionEmbedding,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from runtime.parallel_state import Group, ProcessGroups

H, VOCAB, Q, KV = 8, 16, 8, 4  # GQA: q has twice the size of k and v


class TinyModel(nn.Module):
    def __init__(self, tp: Group):
        super().__init__()
        self.embedding = VocabParallelEmbedding(VOCAB, H, tp=tp)
        self.position = PositionEmbedding(12, H)
        self.norm = LayerNorm(H)
        self.qkv = ColumnParallelLinear(H, Q + 2 * KV, tp=tp, segments=[Q, KV, KV])
        self.gate_up = ColumnParallelLinear(H, 2 * 12, tp=tp, segments=[12, 12], input_mode="gather")
        self.down = RowParallelLinear(12, H, tp=tp, init_std=0.005)
        self.final_norm = RMSNorm(H)
        self.output = ColumnParallelLinear(H, VOCAB, tp=tp, bias=False, weight=self.embedding.weight)


def _check_tp_invariance(rank, world):
    pg = ProcessGroups.initialize(tp=world)
    try:
        sharded, full = TinyModel(pg.tp), TinyModel(Group.single("tp"))
        init_parameters(sharded, seed=1234)
        init_parameters(full, seed=1234)
        names = [n for n, _ in full.named_parameters()]
        assert names == [n for n, _ in sharded.named_parameters()]
        assert "output.weight" not in names  # tied: drawn once, under the embedding's name
        for (name, p), (_, p_full) in zip(sharded.named_parameters(), full.named_parameters()):
            assert torch.equal(full_parameter(p, pg.tp), p_full), name  # bit-exact

        # Per-segment slicing, written out: rank r holds q[r], k[r], v[r].
        w = full.qkv.weight
        q, k, v = w[:Q], w[Q:Q + KV], w[Q + KV:]
        expected = torch.cat([t.chunk(world, dim=0)[rank] for t in (q, k, v)])
        assert torch.equal(sharded.qkv.weight, expected)
        assert torch.equal(sharded.down.weight, full.down.weight.chunk(world, dim=1)[rank])
        assert torch.equal(sharded.embedding.weight, full.embedding.weight.chunk(world, dim=0)[rank])

        # gather_full on a gradient-shaped tensor follows the same segment layout.
        local = torch.full_like(sharded.qkv.weight, float(rank))
        gathered = gather_full(local, sharded.qkv.weight, pg.tp)
        owner = torch.arange(world).repeat_interleave(Q // world)
        owner_kv = torch.arange(world).repeat_interleave(KV // world)
        assert torch.equal(gathered[:, 0], torch.cat([owner, owner_kv, owner_kv]).float())
    finally:
        pg.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_tp_sharded_init_equals_tp1(gloo, world):
    gloo.run(world, _check_tp_invariance)


def _check_randomized_tp_invariance(rank, world):
    pg = ProcessGroups.initialize(tp=world)
    try:
        sharded, full = TinyModel(pg.tp), TinyModel(Group.single("tp"))
        init_parameters(sharded, seed=1234)
        randomize_parameters(sharded, seed=7)
        randomize_parameters(full, seed=7)
        for (name, p), (_, p_full) in zip(sharded.named_parameters(), full.named_parameters()):
            assert torch.equal(full_parameter(p, pg.tp), p_full), name  # the same model at every TP size
    finally:
        pg.destroy()


def test_randomized_weights_are_tp_invariant(gloo):
    gloo.run(2, _check_randomized_tp_invariance)


def test_randomized_weights_have_no_zero_biases_or_unit_gains():
    model = TinyModel(Group.single("tp"))
    init_parameters(model, seed=0)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    randomize_parameters(model, seed=0)
    gains, biases = model.norm.weight, model.qkv.bias
    assert 0.5 <= gains.min() and gains.max() <= 1.5 and (gains - 1).abs().mean() > 0.1
    assert (biases - 0.1).abs().max() < 0.6 and biases.abs().mean() > 0.05 and biases.std() > 0.05
    for name, p in model.named_parameters():
        assert not torch.equal(p, initial[name]), name
    again = TinyModel(Group.single("tp"))
    randomize_parameters(again, seed=0)  # a function of (seed, name) only
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    randomize_parameters(again, seed=1)
    assert not torch.equal(again.down.weight, model.down.weight)


def test_init_kinds_and_stds():
    model = TinyModel(Group.single("tp"))
    init_parameters(model, seed=0)
    assert torch.equal(model.norm.weight, torch.ones(H)) and torch.equal(model.norm.bias, torch.zeros(H))
    assert torch.equal(model.final_norm.weight, torch.ones(H))
    assert torch.equal(model.qkv.bias, torch.zeros(Q + 2 * KV))
    assert torch.equal(model.down.bias, torch.zeros(H))
    big = ColumnParallelLinear(64, 512, tp=Group.single("tp"), init_std=0.02)
    init_parameters(big, seed=0)
    assert abs(big.weight.std().item() - 0.02) < 0.001 and abs(big.weight.mean().item()) < 0.001


def test_draws_depend_on_seed_and_name_only():
    a, b = TinyModel(Group.single("tp")), TinyModel(Group.single("tp"))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    init_parameters(a, seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # torch's global stream untouched
    torch.manual_seed(99)
    init_parameters(b, seed=5)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(a.qkv.weight, a.gate_up.weight[:16])  # different names, different draws
    init_parameters(b, seed=6)
    assert not torch.equal(a.qkv.weight, b.qkv.weight)


def test_stable_seed_is_sha256_not_python_hash():
    digest = hashlib.sha256(b"5:qkv.weight").digest()
    assert stable_seed(5, "qkv.weight") == int.from_bytes(digest[:8], "little") & (2**63 - 1)


def test_untagged_parameters_are_rejected():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="'0.weight' has no init metadata"):
        init_parameters(model, seed=0)


def test_tag_parameter_checks_shapes():
    tp = Group(size=2, rank=1, group=None, ranks=(0, 1), name="tp")
    p = nn.Parameter(torch.empty(6, 4))
    meta = tag_parameter(p, "normal", tp=tp, std=0.1, full_shape=(12, 4), shard_dim=0, segments=[8, 4])._specc_init
    assert (meta.tp_rank, meta.tp_size, meta.local_shape) == (1, 2, (6, 4))
    with pytest.raises(ValueError, match="does not match its local shape"):
        tag_parameter(nn.Parameter(torch.empty(5, 4)), "normal", tp=tp, full_shape=(12, 4), shard_dim=0)
    with pytest.raises(ValueError, match="do not sum"):
        tag_parameter(p, "normal", tp=tp, full_shape=(12, 4), shard_dim=0, segments=[8, 2])
    with pytest.raises(ValueError, match="kind must be one of"):
        tag_parameter(p, "uniform")


def test_single_process_gather_full_is_identity():
    assert not dist.is_initialized()
    layer = ColumnParallelLinear(4, 6, tp=Group.single("tp"), segments=[2, 2, 2])
    init_parameters(layer, seed=0)
    assert torch.equal(full_parameter(layer.weight, Group.single("tp")), layer.weight)
