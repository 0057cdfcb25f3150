"""TP-invariant dropout (the debug mode behind `specc verify --tp-invariant-dropout`): each rank's
mask is its slice of the mask TP=1 draws, for sequence- and head-sharded values alike."""

from __future__ import annotations

import torch

from runtime import CoreAttention, Dropout, Group, RNGTracker


def rank_group(rank: int, size: int) -> Group:
    return Group(size=size, rank=rank, group=None, ranks=tuple(range(size)), name="tp")


def test_sequence_sharded_dropout_slices_the_full_mask():
    x = torch.randn(8, 2, 6)
    full = Dropout(0.5, rng_tracker=RNGTracker(3, 0, tp_invariant=True))(x)
    assert (full == 0).any() and not torch.equal(full, x)  # dropout really ran
    pieces = [Dropout(0.5, rng_tracker=RNGTracker(3, r, tp_invariant=True), stream="tensor-parallel", layout="S(s)",
                      tp=rank_group(r, 2))(x.chunk(2, dim=0)[r]) for r in range(2)]
    assert torch.equal(torch.cat(pieces, dim=0), full)


def test_context_parallel_dropout_keeps_the_load_balanced_chunks_then_the_tp_slice():
    """CP=2 x TP=2 with SP: rank (c, t) holds chunks c and 3-c of the sequence (cut in 4), and TP
    slice t of those rows; its mask is that piece of the full sequence's mask."""
    from runtime.context_parallel import load_balanced_positions

    x = torch.randn(16, 2, 6)
    full = Dropout(0.5, rng_tracker=RNGTracker(3, 0, tp_invariant=True))(x)
    for c in range(2):
        cp = Group(size=2, rank=c, group=None, ranks=(0, 1), name="cp")
        rows = x.index_select(0, load_balanced_positions(8, cp))
        for t in range(2):
            mine = Dropout(0.5, rng_tracker=RNGTracker(3, t, tp_invariant=True, cp_rank=c), stream="tensor-parallel",
                           layout="S(s)", tp=rank_group(t, 2), cp=cp)(rows.chunk(2, dim=0)[t])
            expected = full.index_select(0, load_balanced_positions(8, cp)).chunk(2, dim=0)[t]
            assert torch.equal(mine, expected), (c, t)


def test_feature_sharded_dropout_slices_the_full_mask():
    x = torch.randn(4, 2, 8)
    full = Dropout(0.3, rng_tracker=RNGTracker(5, 0, tp_invariant=True))(x)
    pieces = [Dropout(0.3, rng_tracker=RNGTracker(5, r, tp_invariant=True), stream="tensor-parallel", layout="S(h)",
                      tp=rank_group(r, 4))(x.chunk(4, dim=-1)[r]) for r in range(4)]
    assert torch.equal(torch.cat(pieces, dim=-1), full)


def test_attention_dropout_keeps_each_ranks_heads():
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4 * 8) for _ in range(3))
    full = CoreAttention(4, 4, 8, dropout=0.5, backend="sdpa", rng_tracker=RNGTracker(9, 0, tp_invariant=True))(q, k, v)
    pieces = []
    for r in range(2):
        attn = CoreAttention(2, 2, 8, dropout=0.5, backend="sdpa", rng_tracker=RNGTracker(9, r, tp_invariant=True),
                             tp=rank_group(r, 2))
        pieces.append(attn(*(t.chunk(2, dim=-1)[r] for t in (q, k, v))))
    torch.testing.assert_close(torch.cat(pieces, dim=-1), full)
    no_dropout = CoreAttention(4, 4, 8, backend="sdpa")(q, k, v)
    assert not torch.allclose(full, no_dropout)


def test_successive_calls_draw_new_masks():
    tracker = RNGTracker(1, 0, tp_invariant=True)
    a = tracker.full_keep_mask((64,), 0.5)
    b = tracker.full_keep_mask((64,), 0.5)
    assert not torch.equal(a, b) and tracker.calls == 2
