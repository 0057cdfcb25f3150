"""Context parallelism: load-balanced order, CP mappings, rotary/positions, point-to-point, and
attention over the CP group (ring p2p and all-gather) against full-sequence SDPA.

Tolerances (fp32 attention, at most 32 keys, head_dim 8): each output and gradient element is
a sum of at most 32 * 8 rounded fp32 products, and the log-sum-exp merge adds a few roundings
per ring step, so the error is at most ~ (32 + 8 + 4N) * 2**-24 ~ 3e-6 of the largest
magnitude in play; the reference is exact fp64 of the same fp32 inputs. 1e-5 of the tensor's
largest magnitude (rtol 0) bounds that without depending on a reduction order.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import comm, mappings
from runtime.attention import CoreAttention
from runtime.comm import CommCounter
from runtime.context_parallel import (
    FULL,
    PARTIAL,
    SKIP,
    _ring_block,
    _ring_blocks,
    chunk_pair_kind,
    context_parallel_attention,
    get_batch_on_this_cp_rank,
    load_balanced_positions,
    split_load_balanced,
)
from runtime.layers import PositionEmbedding, RotaryEmbedding
from runtime.parallel_state import Group, ProcessGroups
from runtime.random import RNGTracker

F32, F64 = 4, 8
B, D = 2, 8  # batch, head_dim
HEADS, KV_HEADS = (4, 4), (4, 2)  # (heads, kv heads) before TP: MHA and GQA


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def fake_cp(size, rank):  # for helpers that do not communicate
    return Group(size=size, rank=rank, group=None, ranks=tuple(range(size)), name="cp")


def close_to(actual, expected, what):
    # see the module docstring: 1e-5 of the largest magnitude, whatever the reduction order
    atol = 1e-5 * expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def reference(q, k, v, causal):
    """Full-sequence attention in fp64 (SDPA), inputs [S, b, n*d]; returns out and grads."""
    S = q.shape[0]
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    qh, kh, vh = (t.view(S, B, -1, D).permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=qh.shape[1] != kh.shape[1])
    return out.permute(2, 0, 1, 3).reshape(S, B, -1), (q, k, v)


# ---------------------------------------------------------------------------
# Single process.


def test_load_balanced_positions_and_split():
    assert load_balanced_positions(8, fake_cp(2, 0)).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(8, fake_cp(2, 1)).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert load_balanced_positions(4, fake_cp(4, 1)).tolist() == [2, 3, 12, 13]
    assert load_balanced_positions(5, Group.single("cp")).tolist() == [0, 1, 2, 3, 4]
    every = torch.cat([load_balanced_positions(4, fake_cp(4, r)) for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))  # a permutation
    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    for r in range(4):
        pos = load_balanced_positions(4, fake_cp(4, r))
        assert torch.equal(split_load_balanced(x, fake_cp(4, r), dim=1), x[:, pos])
        assert torch.equal(split_load_balanced(x.transpose(0, 1), fake_cp(4, r), dim=0), x.transpose(0, 1)[pos])
    batch = get_batch_on_this_cp_rank({"tokens": x[..., 0], "labels": x[..., 1], "loss_mask": None}, fake_cp(4, 3))
    pos = load_balanced_positions(4, fake_cp(4, 3))
    assert torch.equal(batch["tokens"], x[:, pos, 0]) and torch.equal(batch["labels"], x[:, pos, 1])
    assert batch["loss_mask"] is None
    with pytest.raises(ValueError, match="even"):
        load_balanced_positions(5, fake_cp(2, 0))
    with pytest.raises(ValueError, match="divisible"):
        split_load_balanced(x, fake_cp(3, 0), dim=1)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_one_rank_cp_attention_is_plain_attention(comm_type):
    S, (nh, ng) = 8, KV_HEADS
    q, k, v = (seeded(i, S, B, n * D).float().requires_grad_(True) for i, n in enumerate((nh, ng, ng)))
    for causal in (True, False):
        out = context_parallel_attention(q, k, v, num_heads=nh, num_kv_heads=ng, head_dim=D,
                                         cp=Group.single("cp"), comm_type=comm_type, causal=causal)
        ref, leaves = reference(q, k, v, causal)
        close_to(out, ref, "out")
        dout = seeded(9, *out.shape)
        grads = torch.autograd.grad(out, (q, k, v), dout.float())
        for g, r in zip(grads, torch.autograd.grad(ref, leaves, dout)):
            close_to(g, r, "grad")


def _allowed(q_pos, k_pos, causal, window):
    """The CP=1 mask of runtime.attention.CoreAttention, by explicit positions (True: attend)."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = torch.ones(diff.shape, dtype=torch.bool)
    if causal:
        allowed &= diff >= 0
    if window is not None:
        allowed &= diff.abs() < window
    return allowed


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_blocks_cover_exactly_what_the_mask_keeps(n):
    """Every rank, every step, every mask: the blocks the ring computes cover each kept (query,
    key) pair once, skip only chunk pairs with none kept, and a block left unmasked keeps all."""
    c = 3
    for causal in (True, False):
        for window in (None, 1, 2, 3, 4, 7, 100):
            for rank in range(n):
                q_pos = load_balanced_positions(2 * c, fake_cp(n, rank))
                for step in range(n):
                    k_pos = load_balanced_positions(2 * c, fake_cp(n, (rank - step) % n))
                    allowed = _allowed(q_pos, k_pos, causal, window)
                    covered = torch.zeros(2 * c, 2 * c, dtype=torch.int64)
                    for rows, cols, partial in _ring_blocks(step, rank, n, 2 * c, causal, window):
                        covered[rows, cols] += 1
                        assert partial or allowed[rows, cols].all(), (n, causal, window, rank, step)
                    what = (n, causal, window, rank, step)
                    assert covered.max() <= 1, what  # no pair twice
                    assert not (allowed & (covered == 0)).any(), what  # nothing kept is skipped
                    for qi in (0, 1):  # a chunk pair computed has something kept
                        for ki in (0, 1):
                            block = (slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c))
                            assert not covered[block].any() or allowed[block].any(), what
    # the compiler counts the ring's FLOPs by its own copy of the rule (specc imports no torch)
    from specc.ops.attention import _chunk_pair_kind

    assert all(chunk_pair_kind(q0, k0, c, causal, w) == _chunk_pair_kind(q0, k0, c, causal, w)
               for q0 in range(0, 24, 3) for k0 in range(0, 24, 3) for causal in (True, False)
               for w in (None, 1, 2, 3, 4, 6, 7, 30))
    assert chunk_pair_kind(8, 0, 4, True, 3) == SKIP and chunk_pair_kind(4, 0, 4, True, None) == FULL
    assert chunk_pair_kind(4, 0, 4, True, 4) == PARTIAL and chunk_pair_kind(0, 8, 4, False, 5) == SKIP
    assert chunk_pair_kind(0, 4, 4, True, None) == SKIP and chunk_pair_kind(0, 8, 4, False, 6) == PARTIAL


def _size(s: slice) -> int:
    return s.stop - s.start


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_plan_counts_the_pairs_the_ring_computes(n):
    """specc/ops/attention.py's cp_computed_pairs (the time model's count, by its own copy of the
    rule) equals the query x key pairs of the blocks the ring computes, averaged over the ranks:
    the plain causal or bidirectional ring's blocks, and those cut by chunk pairs under a mask by
    position (a window, documents), the masked pairs inside them included."""
    from specc.ops.attention import cp_computed_pairs

    for c in (3, 4):
        for causal in (True, False):
            for window, by_position in [(None, False), (None, True), (1, True), (3, True), (4, True), (7, True),
                                        (100, True)]:
                total = 0
                for rank in range(n):
                    for step in range(n):
                        if by_position:
                            blocks = [(r, k) for r, k, _ in _ring_blocks(step, rank, n, 2 * c, causal, window)]
                        else:
                            blocks = [(r, k) for r, k, _ in _ring_block(step, rank, n, 2 * c, causal)]
                        total += sum(_size(rows) * _size(cols) for rows, cols in blocks)
                assert cp_computed_pairs(2 * c, n, "p2p", causal, window, by_position) == total // n, \
                    (n, c, causal, window, by_position)
    assert cp_computed_pairs(8, 2, "p2p", True, None, False) == 3 * 16 + 2 * 16  # 3 of 4 chunk pairs, then half


def test_cp_argument_checks():
    with pytest.raises(ValueError, match="sdpa"):
        CoreAttention(4, 4, 8, backend="te", cp=fake_cp(2, 0))
    with pytest.raises(ValueError, match="cp_comm_type"):
        CoreAttention(4, 4, 8, cp_comm_type="a2a")
    q = torch.zeros(6, 1, 8)
    with pytest.raises(ValueError, match="even"):
        context_parallel_attention(q[:5], q[:5], q[:5], num_heads=1, num_kv_heads=1, head_dim=8, cp=fake_cp(2, 0))
    with pytest.raises(ValueError, match="comm type"):
        context_parallel_attention(q, q, q, num_heads=1, num_kv_heads=1, head_dim=8, cp=fake_cp(2, 0),
                                   comm_type="ring")
    with pytest.raises(ValueError, match="neither"):
        comm.send_recv(q, None, None, None, fake_cp(2, 0))
    with pytest.raises(ValueError, match="another rank"):
        comm.send_recv(q, 0, None, None, fake_cp(2, 0))


# ---------------------------------------------------------------------------
# gloo ranks.


def _check_send_recv(rank, world):
    g = Group(size=world, rank=rank, group=dist.group.WORLD, ranks=tuple(range(world)), name="cp")
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    with CommCounter() as c:
        got = torch.empty(3)
        for work in comm.send_recv(torch.full((3,), float(rank)), nxt, got, prev, g, tag=3):
            work.wait()
        assert torch.equal(got, torch.full((3,), float(prev)))
        # one side only: even ranks send to the next rank, odd ranks receive from the previous one
        one = torch.zeros(2, dtype=torch.float64)
        works = (comm.send_recv(one + rank, nxt, None, None, g) if rank % 2 == 0
                 else comm.send_recv(None, None, one, prev, g))
        for work in works:
            work.wait()
        assert rank % 2 == 0 or torch.equal(one, torch.full((2,), float(prev), dtype=torch.float64))
    sent, received = (1 + (rank % 2 == 0), 1 + (rank % 2 == 1))
    assert c.totals() == {"send": (sent, 3 * F32 + (2 * F64 if rank % 2 == 0 else 0)),
                          "recv": (received, 3 * F32 + (2 * F64 if rank % 2 == 1 else 0))}
    assert {r.group for r in c.records} == {"cp"}


def _check_mappings_and_positions(rank, world):
    pg = ProcessGroups.initialize(cp=world)
    cp = pg.cp
    try:
        S, h = 8 * world, 3
        pos = load_balanced_positions(S // world, cp)
        x_full = seeded(1, S, B, h).requires_grad_(True)
        big_g = seeded(2, S, B, h)
        with CommCounter() as fwd:
            y = mappings.scatter_to_context_parallel_region(x_full, cp, 0)
        assert torch.equal(y, x_full.detach()[pos]) and fwd.records == []
        with CommCounter() as bwd:
            y.backward(big_g[pos])
        assert torch.equal(x_full.grad, big_g)  # every rank's rows, in natural order
        assert bwd.totals() == {"all_gather": (1, S * B * h * F64)}

        x_local = seeded(1, S, B, h)[pos].requires_grad_(True)
        with CommCounter() as fwd:
            y = mappings.gather_from_context_parallel_region(x_local, cp, 0)
        assert torch.equal(y, x_full.detach()) and fwd.totals() == {"all_gather": (1, S * B * h * F64)}
        with CommCounter() as bwd:
            y.backward(big_g)
        assert torch.equal(x_local.grad, big_g[pos]) and bwd.records == []

        tokens = torch.randint(0, 100, (B, S), generator=torch.Generator().manual_seed(3))
        local_tokens = mappings.scatter_to_context_parallel_region(tokens, cp, 1)
        assert torch.equal(local_tokens, tokens[:, pos])
        assert torch.equal(mappings.gather_from_context_parallel_region(local_tokens, cp, 1), tokens)
        losses = seeded(4, B, S)[:, pos].requires_grad_(True)
        full_losses = mappings.gather_from_context_parallel_region(losses, cp, 1)
        assert torch.equal(full_losses, seeded(4, B, S))
        full_losses.backward(seeded(5, B, S))
        assert torch.equal(losses.grad, seeded(5, B, S)[:, pos])

        # rotary and learned positions follow the chunks
        x = seeded(6, S, B, 2 * D)
        assert torch.equal(RotaryEmbedding(D, cp=cp)(x[pos]), RotaryEmbedding(D)(x)[pos])
        full_pe, cp_pe = PositionEmbedding(S, h), PositionEmbedding(S, h, cp=cp)
        with torch.no_grad():
            for pe in (full_pe, cp_pe):
                pe.weight.copy_(seeded(7, S, h))
        expected = full_pe(tokens)
        got = cp_pe(tokens[:, pos])
        assert torch.equal(got, expected[pos])
        expected.backward(seeded(8, S, B, h))
        got.backward(seeded(8, S, B, h)[pos])
        summed = cp_pe.weight.grad.clone()
        comm.all_reduce(summed, cp)  # the weight gradient is CP-partial: reduced over CP it is complete
        torch.testing.assert_close(summed, full_pe.weight.grad, rtol=0, atol=0)
        with pytest.raises(ValueError, match="max_positions"):
            PositionEmbedding(S - 1, h, cp=cp)(tokens[:, pos])
    finally:
        pg.destroy()


def _rank_heads(pg, heads, seed, dtype):
    """q, k, v over the full sequence of 8 * CP tokens (seeds seed, seed+1, seed+2), cut to this TP
    rank's heads; with the local head counts and this CP rank's global positions."""
    tp, cp = pg.tp, pg.cp
    (nh, ng), S = heads, 8 * cp.size
    pos = load_balanced_positions(S // cp.size, cp)
    full = [seeded(seed + i, S, B, m * D).to(dtype) for i, m in enumerate((nh, ng, ng))]
    local_heads = [t.view(S, B, m, D)[:, :, tp.rank * (m // tp.size):(tp.rank + 1) * (m // tp.size)]
                   .reshape(S, B, -1) for t, m in zip(full, (nh, ng, ng))]
    return nh // tp.size, ng // tp.size, S, pos, local_heads


def _attention_case(pg, causal, heads, comm_type):
    """CP attention of this rank's chunks vs full SDPA: out, grads and exact comm counts."""
    tp, cp, n = pg.tp, pg.cp, pg.cp.size
    nh_l, ng_l, S, pos, local_heads = _rank_heads(pg, heads, 10, torch.float32)
    q, k, v = (t[pos].clone().requires_grad_(True) for t in local_heads)
    with CommCounter() as fwd:
        out = context_parallel_attention(q, k, v, num_heads=nh_l, num_kv_heads=ng_l, head_dim=D, cp=cp,
                                         comm_type=comm_type, causal=causal)
    ref, leaves = reference(*local_heads, causal)
    what = f"cp={n} tp={tp.size} causal={causal} heads={heads} {comm_type}"
    close_to(out, ref[pos], f"{what} out")
    dout = seeded(20, S, B, nh_l * D)
    with CommCounter() as bwd:
        out.backward(dout[pos].float())
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), torch.autograd.grad(ref, leaves, dout)):
        close_to(got, want[pos], f"{what} d{name}")

    kv_bytes = 2 * (S // n) * B * ng_l * D * F32  # one K/V message: [2, s_local, b, kv_heads * d]
    if comm_type == "p2p":
        assert fwd.totals() == {"send": (n - 1, (n - 1) * kv_bytes), "recv": (n - 1, (n - 1) * kv_bytes)}, what
        steps = (n - 1) + n  # K/V again, then the dK/dV accumulators
        assert bwd.totals() == {"send": (steps, steps * kv_bytes), "recv": (steps, steps * kv_bytes)}, what
    else:
        one = S * B * ng_l * D * F32  # all-gather: the gathered K (or V); reduce-scatter: its full input
        assert fwd.totals() == {"all_gather": (2, 2 * one)}, what
        assert bwd.totals() == {"reduce_scatter": (2, 2 * one)}, what
    assert {r.group for r in fwd.records + bwd.records} == {"cp"}


def _dropout_case(pg, comm_type):
    """Dropout with CP: the TP-invariant tracker drops exactly what the CP=1 unfused path drops;
    the ordinary stream is replayed in backward (checked by directional derivatives)."""
    tp, cp, n = pg.tp, pg.cp, pg.cp.size
    nh_l, ng_l, S, pos, local_heads = _rank_heads(pg, KV_HEADS, 30, torch.float64)
    what = f"dropout cp={n} tp={tp.size} {comm_type}"

    # TP-invariant masks: exactly the CP=1 result
    ref_leaves = [t.float().requires_grad_(True) for t in local_heads]
    ref_attn = CoreAttention(nh_l, ng_l, D, dropout=0.25, backend="unfused", tp=tp,
                             rng_tracker=RNGTracker(5, tp.rank, tp_invariant=True)).train()
    ref = ref_attn(*ref_leaves)
    cp_leaves = [t.float()[pos].clone().requires_grad_(True) for t in local_heads]
    cp_attn = CoreAttention(nh_l, ng_l, D, dropout=0.25, backend="sdpa", tp=tp, cp=cp, cp_comm_type=comm_type,
                            rng_tracker=RNGTracker(5, tp.rank, tp_invariant=True)).train()
    out = cp_attn(*cp_leaves)
    close_to(out, ref.detach()[pos], f"{what} out")
    dout = seeded(40, S, B, nh_l * D).float()
    ref.backward(dout)
    out.backward(dout[pos])
    for name, got, leaf in zip("qkv", cp_leaves, ref_leaves):
        close_to(got.grad, leaf.grad[pos], f"{what} d{name}")
    plain = CoreAttention(nh_l, ng_l, D, tp=tp, cp=cp, cp_comm_type=comm_type)(*cp_leaves)
    assert not torch.allclose(out, plain)  # something was dropped

    # ordinary stream, fp64: a fresh tracker per call gives the same masks; the gradient of
    # L = sum over ranks <dout, y> matches central differences along a random direction.
    world = Group(size=dist.get_world_size(), rank=dist.get_rank(), group=dist.group.WORLD,
                  ranks=tuple(range(dist.get_world_size())), name="world")

    def attn(q, k, v):
        module = CoreAttention(nh_l, ng_l, D, dropout=0.25, tp=tp, cp=cp, cp_comm_type=comm_type,
                               rng_tracker=RNGTracker(9, tp.rank)).train()
        return module(q, k, v)

    def total(t):
        t = t.detach().clone().reshape(1)
        comm.all_reduce(t, world)
        return t.item()

    leaves = [t[pos].clone().requires_grad_(True) for t in local_heads]
    dout64 = seeded(41, S, B, nh_l * D)[pos]
    y = attn(*leaves)
    assert torch.equal(y, attn(*leaves)), f"{what}: the same stream state gives the same masks"
    grads = torch.autograd.grad(y, leaves, dout64)
    eps = 1e-4  # central differences: truncation ~eps**2, rounding ~1e-16/eps, both far below 1e-7
    for i, name in enumerate("qkv"):
        direction = seeded(50 + i + 10 * dist.get_rank(), *leaves[i].shape)
        shifted = [[t.detach() + sign * eps * direction if j == i else t.detach() for j, t in enumerate(leaves)]
                   for sign in (1, -1)]
        numeric = total(((attn(*shifted[0]) - attn(*shifted[1])) * dout64).sum()) / (2 * eps)
        analytic = total((grads[i] * direction).sum())
        assert math.isclose(numeric, analytic, rel_tol=1e-7, abs_tol=1e-9), (what, name, numeric, analytic)


def _documents(S, seed):
    """[B, S] document ids: each row cut at random points into documents of unequal lengths."""
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(B, S, generator=g) < 0.3).long()
    starts[:, 0] = 1
    return starts.cumsum(1)


MASKS = [  # (causal, window, softcap, documents[, chunk, ALiBi]): a window below, equal to and above the
    # CP chunk; Llama 4's chunks of 3 and 5 (across the CP chunks), ALiBi alone and with the others
    (True, 3, None, False), (True, 4, 1.5, True), (False, 5, 2.0, False), (False, None, None, True),
    (True, None, 1.5, False), (False, 2, None, True),
    (True, None, None, False, None, True), (True, None, None, True, 3, True), (True, 5, None, False, 5, False),
]


def _masked_case(pg, comm_type, causal, window, softcap, documents, chunk=None, alibi=False):
    """Windows, chunks, ALiBi, soft-capped scores and documents by global position vs CP=1's
    CoreAttention in fp64 (its own mask and bias): out and every gradient, both comm types."""
    tp, cp, n = pg.tp, pg.cp, pg.cp.size
    nh_l, ng_l, S, pos, local_heads = _rank_heads(pg, KV_HEADS, 60, torch.float32)
    docs = _documents(S, 7) if documents else None
    ref_leaves = [t.double().requires_grad_(True) for t in local_heads]
    kw = dict(causal=causal, window=window, softcap=softcap, chunk=chunk, alibi_max_bias=8.0 if alibi else None, tp=tp)
    ref = CoreAttention(nh_l, ng_l, D, backend="unfused", **kw)(*ref_leaves, docs)
    q, k, v = (t[pos].clone().requires_grad_(True) for t in local_heads)
    out = CoreAttention(nh_l, ng_l, D, cp=cp, cp_comm_type=comm_type, **kw)(q, k, v, docs)
    what = (f"cp={n} tp={tp.size} {comm_type} causal={causal} window={window} softcap={softcap} docs={documents} "
            f"chunk={chunk} alibi={alibi}")
    close_to(out, ref.detach()[pos], f"{what} out")
    dout = seeded(70, S, B, nh_l * D)
    out.backward(dout[pos].float())
    ref.backward(dout)
    for name, got, leaf in zip("qkv", (q.grad, k.grad, v.grad), ref_leaves):
        close_to(got, leaf.grad[pos], f"{what} d{name}")


def _check_attention(rank, world, tp_size, with_dropout):
    pg = ProcessGroups.initialize(tp=tp_size, cp=world // tp_size)
    try:
        for comm_type in ("p2p", "all_gather"):
            for causal in (True, False):
                for heads in (HEADS, KV_HEADS):
                    _attention_case(pg, causal, heads, comm_type)
            if with_dropout:
                _dropout_case(pg, comm_type)
            for mask in MASKS:
                _masked_case(pg, comm_type, *mask)
    finally:
        pg.destroy()


def test_send_recv_ring(gloo):
    gloo.run(2, _check_send_recv)
    gloo.run(4, _check_send_recv)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_mappings_rotary_and_positions(gloo, world):
    gloo.run(world, _check_mappings_and_positions)


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 1), (4, 2)], ids=["cp2", "cp4", "tp2xcp2"])
def test_cp_attention_matches_full_sequence(gloo, world, tp):
    gloo.run(world, _check_attention, tp, True)
