"""Parallel layers vs the unsharded torch layers with the same full weights."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runtime import mappings
from runtime.cross_entropy import vocab_parallel_cross_entropy
from runtime.init import gather_full, init_parameters
from runtime.layers import (
    ColumnParallelLinear,
    Dropout,
    LayerNorm,
    PositionEmbedding,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from runtime.parallel_state import Group
from runtime.random import RNGTracker

S, B = 8, 2
close = torch.testing.assert_close


def world_group(rank, world):
    return Group(size=world, rank=rank, group=dist.group.WORLD, ranks=tuple(range(world)), name="tp")


def fake_group(size, rank=0):
    """A group for constructor checks only: no collective is issued."""
    return Group(size=size, rank=rank, group=None, ranks=tuple(range(size)), name="tp")


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rows(x, rank, world):
    return x.chunk(world, dim=0)[rank]


def cols(x, rank, world):
    return x.chunk(world, dim=-1)[rank]


def segment_slice(full, segments, rank, world, dim):
    """Rank's slice of each segment along dim, concatenated (written out by hand)."""
    pieces, start = [], 0
    for size in segments:
        part = size // world
        pieces.append(full.narrow(dim, start + rank * part, part))
        start += size
    return torch.cat(pieces, dim)


def summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------
# Column / Row / VocabParallelEmbedding on gloo ranks


def _column_case(rank, world, mode, segments):
    g = world_group(rank, world)
    h, out = 6, sum(segments)
    w_full, b_full = seeded(1, out, h), seeded(2, out)
    layer = ColumnParallelLinear(h, out, tp=g, segments=segments, input_mode=mode)
    with torch.no_grad():
        layer.weight.copy_(segment_slice(w_full, segments, rank, world, 0))
        layer.bias.copy_(segment_slice(b_full, segments, rank, world, 0))
    assert torch.equal(gather_full(layer.weight, layer.weight, g), w_full)
    assert torch.equal(gather_full(layer.bias, layer.bias, g), b_full)

    ref = nn.Linear(h, out)
    with torch.no_grad():
        ref.weight.copy_(w_full)
        ref.bias.copy_(b_full)
    x_ref = seeded(3, S, B, h).requires_grad_(True)
    grad_full = seeded(4, S, B, out)
    ref(x_ref).backward(grad_full)

    x = (rows(x_ref, rank, world) if mode == "gather" else x_ref).detach().clone().requires_grad_(True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(x)
    close(y, segment_slice(ref(x_ref), segments, rank, world, -1))
    y.backward(segment_slice(grad_full, segments, rank, world, -1))

    close(gather_full(layer.weight.grad, layer.weight, g), ref.weight.grad)
    close(gather_full(layer.bias.grad, layer.bias, g), ref.bias.grad)
    if mode == "copy":  # the grad-input all-reduce happened inside
        close(x.grad, x_ref.grad)
    elif mode == "gather":  # reduce-scattered inside, and only the shard was saved
        close(x.grad, rows(x_ref.grad, rank, world))
        assert (S // world, B, h) in shapes and (S, B, h) not in shapes, shapes
    else:  # input R: each rank holds a partial input gradient
        close(summed(x.grad), x_ref.grad)


def _column_autocast_case(rank, world, mode):
    """bf16 autocast: backward runs outside autocast and must reconcile dtypes."""
    g = world_group(rank, world)
    layer = ColumnParallelLinear(6, 8, tp=g, input_mode=mode)
    with torch.no_grad():
        layer.weight.copy_(rows(seeded(1, 8, 6), rank, world))
        layer.bias.copy_(rows(seeded(2, 8), rank, world))
    x_full = seeded(3, S, B, 6)
    x = (rows(x_full, rank, world) if mode == "gather" else x_full).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32
    w_full = seeded(1, 8, 6)
    expected_dx = torch.ones(S, B, 8) @ w_full  # d(sum(x W^T))/dx, summed over all ranks' columns
    close(x.grad, rows(expected_dx, rank, world) if mode == "gather" else expected_dx, atol=5e-2, rtol=2e-2)
    close(layer.bias.grad, torch.full((8 // world,), float(S * B)))


def _check_column(rank, world):
    for mode in ("none", "copy", "gather"):
        for segments in ([12], [8, 4, 4], [8, 8]):  # plain, GQA q/k/v, gate/up
            _column_case(rank, world, mode, segments)
    for mode in ("copy", "gather"):
        _column_autocast_case(rank, world, mode)


def _check_row(rank, world):
    g = world_group(rank, world)
    h_in, h_out = 8, 6
    w_full, b_full = seeded(1, h_out, h_in), seeded(2, h_out)
    layer = RowParallelLinear(h_in, h_out, tp=g)
    assert tuple(layer.weight.shape) == (h_out, h_in // world) and tuple(layer.bias.shape) == (h_out,)
    with torch.no_grad():
        layer.weight.copy_(cols(w_full, rank, world))
        layer.bias.copy_(b_full)
    ref = nn.Linear(h_in, h_out)
    with torch.no_grad():
        ref.weight.copy_(w_full)
        ref.bias.copy_(b_full)
    x_ref = seeded(3, S, B, h_in).requires_grad_(True)
    grad_full = seeded(4, S, B, h_out)
    y_ref = ref(x_ref)
    y_ref.backward(grad_full)

    x = cols(x_ref, rank, world).detach().clone().requires_grad_(True)
    partial = layer(x)
    close(partial, cols(x_ref, rank, world) @ cols(w_full, rank, world).t())  # no reduction, no bias
    y = mappings.reduce_from_tensor_model_parallel_region(partial, g) + layer.bias
    close(y, y_ref)
    y.backward(grad_full)
    close(x.grad, cols(x_ref.grad, rank, world))
    close(gather_full(layer.weight.grad, layer.weight, g), ref.weight.grad)
    close(layer.bias.grad, ref.bias.grad)


def _check_vocab_embedding(rank, world):
    g = world_group(rank, world)
    vocab, h = 16, 6
    w_full = seeded(1, vocab, h)
    layer = VocabParallelEmbedding(vocab, h, tp=g)
    with torch.no_grad():
        layer.weight.copy_(rows(w_full, rank, world))
    ref = nn.Embedding(vocab, h)
    with torch.no_grad():
        ref.weight.copy_(w_full)
    tokens = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(5))
    tokens[0, :4] = torch.tensor([0, vocab // world - 1, vocab // world, vocab - 1])  # shard edges

    out = layer(tokens)
    assert out.shape == (S, B, h) and out.is_contiguous()
    mine = (tokens >= rank * vocab // world) & (tokens < (rank + 1) * vocab // world)
    close(out, (ref(tokens) * mine[..., None]).transpose(0, 1))  # rows of other ranks give zeros
    y = mappings.reduce_from_tensor_model_parallel_region(out, g)
    y_ref = ref(tokens).transpose(0, 1)
    close(y, y_ref)
    grad_full = seeded(4, S, B, h)
    y.backward(grad_full)
    y_ref.backward(grad_full)
    close(gather_full(layer.weight.grad, layer.weight, g), ref.weight.grad)


class TiedLM(nn.Module):
    """Embedding -> tied output layer -> vocab-parallel cross-entropy."""

    def __init__(self, tp, vocab=16, h=6):
        super().__init__()
        self.tp = tp
        self.embedding = VocabParallelEmbedding(vocab, h, tp=tp, init_std=0.5)
        self.output_layer = ColumnParallelLinear(
            h, vocab, tp=tp, bias=False, input_mode="copy", weight=self.embedding.weight
        )

    def forward(self, tokens, labels):
        x = mappings.reduce_from_tensor_model_parallel_region(self.embedding(tokens), self.tp)
        return vocab_parallel_cross_entropy(self.output_layer(x), labels, self.tp).mean()


def _check_tied_output_layer(rank, world):
    g = world_group(rank, world)
    model, ref = TiedLM(g), TiedLM(Group.single("tp"))
    assert model.output_layer.weight is model.embedding.weight
    assert [n for n, _ in model.named_parameters()] == ["embedding.weight"]  # drawn once
    init_parameters(model, seed=7)
    init_parameters(ref, seed=7)
    tokens = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(2))
    loss, loss_ref = model(tokens, labels), ref(tokens, labels)
    close(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    # The gradient sums both uses of the shared weight.
    close(gather_full(model.embedding.weight.grad, model.embedding.weight, g), ref.embedding.weight.grad)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_unsharded(gloo, world):
    gloo.run(world, _check_column)
    gloo.run(world, _check_row)
    gloo.run(world, _check_vocab_embedding)
    gloo.run(world, _check_tied_output_layer)


# ---------------------------------------------------------------------------
# Constructor checks (no communication needed)


def test_column_local_shapes_and_validation():
    layer = ColumnParallelLinear(6, 16, tp=fake_group(4, 1), segments=[8, 4, 4])
    assert tuple(layer.weight.shape) == (4, 6) and tuple(layer.bias.shape) == (4,)
    assert layer.weight._specc_init.segments == (8, 4, 4)
    with pytest.raises(ValueError, match="segment of size 6 .* not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(6, 12, tp=fake_group(4), segments=[6, 6])
    with pytest.raises(ValueError, match="sum to 10, not out_features=12"):
        ColumnParallelLinear(6, 12, tp=fake_group(2), segments=[6, 4])
    with pytest.raises(ValueError, match="input_mode must be one of"):
        ColumnParallelLinear(6, 12, tp=fake_group(2), input_mode="scatter")
    with pytest.raises(ValueError, match="in_features .* not divisible"):
        RowParallelLinear(6, 12, tp=fake_group(4))
    with pytest.raises(ValueError, match="num_embeddings .* not divisible"):
        VocabParallelEmbedding(10, 4, tp=fake_group(4))


def test_tied_weight_is_checked():
    emb = VocabParallelEmbedding(16, 6, tp=fake_group(2))
    tied = ColumnParallelLinear(6, 16, tp=fake_group(2), bias=False, weight=emb.weight)
    assert tied.weight is emb.weight
    with pytest.raises(ValueError, match=r"shared weight has shape \(8, 6\), expected \(4, 6\)"):
        ColumnParallelLinear(6, 8, tp=fake_group(2), weight=emb.weight)
    with pytest.raises(ValueError, match="segments"):
        ColumnParallelLinear(6, 16, tp=fake_group(2), segments=[8, 8], weight=emb.weight)


def test_single_process_layers_are_plain_torch():
    tp = Group.single("tp")
    col = ColumnParallelLinear(6, 12, tp=tp, input_mode="gather")
    row = RowParallelLinear(12, 6, tp=tp)
    emb = VocabParallelEmbedding(16, 6, tp=tp)
    for module in (col, row, emb):
        init_parameters(module, seed=0)
        for p in module.parameters():  # zero-initialized biases get values to compare
            nn.init.normal_(p)
    x = seeded(0, S, B, 6)
    close(col(x), nn.functional.linear(x, col.weight, col.bias))
    close(row(col(x)), col(x) @ row.weight.t())
    tokens = torch.randint(0, 16, (B, S))
    close(emb(tokens), emb.weight[tokens].transpose(0, 1))


# ---------------------------------------------------------------------------
# Norms, rotary, positions, dropout (single process)


def test_layer_norm_matches_torch():
    x = seeded(0, S, B, 10)
    ours, ref = LayerNorm(10, eps=1e-5), nn.LayerNorm(10, eps=1e-5)
    assert torch.equal(ours.weight, torch.ones(10)) and torch.equal(ours.bias, torch.zeros(10))
    with torch.no_grad():
        for p, q in ((ours.weight, ref.weight), (ours.bias, ref.bias)):
            p.copy_(seeded(1, 10))
            q.copy_(p)
    close(ours(x), ref(x))
    assert ours(x.bfloat16()).dtype == torch.bfloat16


def test_rms_norm_matches_formula():
    x = seeded(0, S, B, 10).requires_grad_(True)
    norm = RMSNorm(10, eps=1e-6)
    assert torch.equal(norm.weight, torch.ones(10))
    with torch.no_grad():
        norm.weight.copy_(seeded(1, 10))
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    close(norm(x), expected)
    y = x.detach().bfloat16()
    assert norm(y).dtype == torch.bfloat16


def _rotary_reference(x, head_dim, base):
    """Rotate each pair (x_i, x_{i + d/2}) of every head by angle pos * base^(-2i/d)."""
    s, b, width = x.shape
    out = x.clone()
    half = head_dim // 2
    for pos in range(s):
        for head in range(width // head_dim):
            o = head * head_dim
            for i in range(half):
                theta = pos * base ** (-2 * i / head_dim)
                c, sn = math.cos(theta), math.sin(theta)
                a, bb = x[pos, :, o + i], x[pos, :, o + i + half]
                out[pos, :, o + i] = a * c - bb * sn
                out[pos, :, o + i + half] = bb * c + a * sn
    return out


def test_rotary_matches_direct_formula():
    x = seeded(0, 6, 2, 3 * 8).double()
    rope = RotaryEmbedding(8, base=100.0)
    close(rope(x), _rotary_reference(x, 8, 100.0))
    # The cache built for 6 positions serves a shorter sequence, and a longer one rebuilds it.
    close(rope(x[:3]), _rotary_reference(x[:3], 8, 100.0))
    longer = seeded(1, 9, 2, 8).double()
    close(rope(longer), _rotary_reference(longer, 8, 100.0))
    # A non-contiguous input (a q slice of a fused qkv output) works too.
    qkv = seeded(2, 6, 2, 40).double()
    close(rope(qkv[..., :24]), _rotary_reference(qkv[..., :24].contiguous(), 8, 100.0))
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)


def test_position_embedding():
    pos = PositionEmbedding(10, 4)
    init_parameters(pos, seed=0)
    tokens = torch.zeros(3, 5, dtype=torch.long)
    out = pos(tokens)
    assert out.shape == (5, 3, 4)
    for b in range(3):
        assert torch.equal(out[:, b], pos.weight[:5])
    with pytest.raises(ValueError, match="sequence length 11 exceeds max_positions=10"):
        pos(torch.zeros(1, 11, dtype=torch.long))


def test_dropout_streams():
    x = torch.ones(64, 4, 8)
    drop0 = Dropout(0.5, rng_tracker=RNGTracker(seed=3, tp_rank=0), stream="default")
    drop1 = Dropout(0.5, rng_tracker=RNGTracker(seed=3, tp_rank=1), stream="default")
    assert torch.equal(drop0(x), drop1(x))  # replicated region: same mask on every rank
    tp0 = Dropout(0.5, rng_tracker=RNGTracker(seed=3, tp_rank=0), stream="tensor-parallel")
    tp1 = Dropout(0.5, rng_tracker=RNGTracker(seed=3, tp_rank=1), stream="tensor-parallel")
    a, b = tp0(x), tp1(x)
    assert not torch.equal(a, b)  # sharded region: different masks
    assert set(a.unique().tolist()) <= {0.0, 2.0}

    state = torch.get_rng_state()
    drop0(x)
    assert torch.equal(torch.get_rng_state(), state)  # the tracker leaves torch's stream alone

    drop0.eval()
    assert drop0(x) is x
    assert Dropout(0.0)(x) is x
    torch.manual_seed(0)
    plain = Dropout(0.5)(x)
    torch.manual_seed(0)
    assert torch.equal(plain, nn.functional.dropout(x, 0.5))  # no tracker: torch's generator
    with pytest.raises(ValueError, match="stream must be one of"):
        Dropout(0.1, stream="sequence")


def test_norm_variants_match_their_formulas():
    x = seeded(0, S, B, 12).double()
    ln = LayerNorm(12, eps=1e-5, bias=False).double()
    assert ln.bias is None and [n for n, _ in ln.named_parameters()] == ["weight"]
    with torch.no_grad():
        ln.weight.copy_(seeded(1, 12))
    close(ln(x), nn.functional.layer_norm(x, (12,), ln.weight, None, 1e-5))
    # (1 + weight), the weight starting at 0 (Gemma): the identity gain at init
    gemma = RMSNorm(12, eps=1e-6, zero_centered_gamma=True).double()
    assert torch.equal(gemma.weight, torch.zeros(12, dtype=torch.float64)) and gemma.weight._specc_init.kind == "zeros"
    with torch.no_grad():
        gemma.weight.copy_(seeded(2, 12))
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    close(gemma(x), rms * (1 + gemma.weight))
    # per head (Qwen3's q/k norm): 3 heads of 4, one [4] weight for all of them
    head = RMSNorm(12, eps=1e-6, head_dim=4).double()
    with torch.no_grad():
        head.weight.copy_(seeded(3, 4))
    h = x.view(S, B, 3, 4)
    close(head(x), (h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6) * head.weight).view(S, B, 12))
    ln_head = LayerNorm(12, head_dim=4).double()
    close(ln_head(x), nn.functional.layer_norm(h, (4,)).view(S, B, 12))
    with pytest.raises(ValueError, match="not a multiple of head_dim"):
        RMSNorm(10, head_dim=4)


def _sharded_rms_norm(rank, world, segments):
    """RMSNorm over the full width of a value sharded over TP (segment by segment when cut so):
    output, input gradient and (summed over ranks) weight gradient equal the unsharded norm's."""
    from runtime.comm import CommCounter
    from runtime.mappings import split_last_segments

    tp = world_group(rank, world)
    width = sum(segments)
    x = seeded(0, S, B, width).double().requires_grad_(True)
    weight = seeded(1, width).double()
    full = RMSNorm(width, eps=1e-6).double()
    sharded = RMSNorm(width, eps=1e-6, tp=tp, segments=segments).double()
    with torch.no_grad():
        full.weight.copy_(weight)
        sharded.weight.copy_(weight)
    grad = seeded(2, S, B, width).double()
    y = full(x)
    (y * grad).sum().backward()
    local = split_last_segments(x.detach(), tp, segments).requires_grad_(True)
    y_local = sharded(local)
    counter = CommCounter()
    with counter:
        (y_local * split_last_segments(grad, tp, segments)).sum().backward()
    close(y_local, split_last_segments(y.detach(), tp, segments))
    close(local.grad, split_last_segments(x.grad, tp, segments))
    wgrad = sharded.weight.grad.clone()
    dist.all_reduce(wgrad)
    close(wgrad, full.weight.grad)
    return [(r.kind, r.bytes) for r in counter.records]


def test_rms_norm_over_the_full_width_of_tp_shards(gloo):
    for segments in ([16], [8, 4, 4]):  # one slab; q, k, v cut segment by segment
        backward = gloo.run(2, _sharded_rms_norm, segments)
        assert backward[0] == [("all_reduce", S * B * 8)]  # the gradient of the per-token sum of squares
