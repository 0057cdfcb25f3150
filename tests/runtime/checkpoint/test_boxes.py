"""The block geometry of checkpoints: a rank's shard (per fused segment) and a data-parallel range
of a flat buffer map to exactly the right blocks of the full tensor."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from runtime.checkpoint.boxes import flat_boxes, flat_range_blocks, param_boxes
from runtime.init import ParamInit, local_slice


def _meta(full_shape, shard_dim, segments, rank, size):
    return ParamInit("normal", 0.02, tuple(full_shape), shard_dim, tuple(segments), rank, size)


def _assemble(full_shape, pieces):
    """Write (offsets, view) pieces into a NaN tensor; every element must be written exactly once."""
    out = torch.full(full_shape, float("nan"))
    count = torch.zeros(full_shape, dtype=torch.int64)
    for offsets, view in pieces:
        index = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
        out[index] = view
        count[index] += 1
    return out, count


def test_segment_shards_are_one_block_per_segment():
    full = torch.randn(64 + 32 + 32, 16)  # GQA [q | k | v]
    pieces = []
    for rank in range(4):
        meta = _meta(full.shape, 0, (64, 32, 32), rank, 4)
        boxes = param_boxes(local_slice(full, meta), meta)
        assert [o for o, _ in boxes] == [(rank * 16, 0), (64 + rank * 8, 0), (96 + rank * 8, 0)]
        pieces += boxes
    out, count = _assemble(full.shape, pieces)
    assert torch.equal(out, full) and bool((count == 1).all())


def test_replicated_heads_are_the_same_box_on_their_replicas():
    # [q | k | v] with 8 query heads and 2 K/V heads of 4 rows at TP=4: ranks 0, 1 hold K/V head 0,
    # ranks 2, 3 head 1; a replicated head is one box written by two ranks (DCP keeps one)
    full = torch.randn(32 + 8 + 8, 6)
    boxes = {}
    for rank in range(4):
        meta = replace(_meta(full.shape, 0, (32, 8, 8), rank, 4), units=(8, 2, 2))
        assert meta.local_shape == (8 + 4 + 4, 6)
        local = local_slice(full, meta)
        mine = param_boxes(local, meta)
        head = rank // 2
        assert [o for o, _ in mine] == [(rank * 8, 0), (32 + head * 4, 0), (40 + head * 4, 0)]
        assert meta.duplicate_rows() == ([] if rank % 2 == 0 else [(8, 4), (12, 4)])
        for offsets, view in mine:
            if offsets in boxes:
                assert torch.equal(boxes[offsets], view)  # the replicas hold the same rows
            boxes[offsets] = view
    out, count = _assemble(full.shape, list(boxes.items()))
    assert torch.equal(out, full) and bool((count == 1).all())
    with pytest.raises(ValueError, match="neither divisible"):
        replace(_meta((32 + 12 + 12, 6), 0, (32, 12, 12), 0, 4), units=(8, 3, 3))
    with pytest.raises(ValueError, match="not a whole number"):
        replace(_meta(full.shape, 0, (32, 8, 8), 0, 4), units=(8, 3, 3))


def test_row_parallel_and_replicated_shards():
    full = torch.randn(8, 12)
    pieces = []
    for rank in range(3):
        meta = _meta(full.shape, 1, (12,), rank, 3)
        boxes = param_boxes(local_slice(full, meta), meta)
        assert boxes[0][0] == (0, rank * 4)
        pieces += boxes
    assert torch.equal(_assemble(full.shape, pieces)[0], full)
    assert param_boxes(full, None)[0][0] == (0, 0)
    one = _meta(full.shape, 0, (4, 4), 0, 1)  # TP=1: the segments are contiguous, one block
    assert len(param_boxes(full, one)) == 1


def test_a_flat_range_is_covered_by_contiguous_blocks():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        total = math.prod(shape)
        start = rng.randint(0, total)
        stop = rng.randint(start, total)
        seen = []
        for offsets, sizes, flat in flat_range_blocks(shape, start, stop):
            index = torch.arange(total).reshape(shape)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            elements = index.reshape(-1).tolist()
            assert elements == list(range(flat, flat + len(elements))), (shape, start, stop)  # contiguous
            seen += elements
        assert sorted(seen) == list(range(start, stop)), (shape, start, stop)


def test_data_parallel_ranges_of_tp_shards_rebuild_the_full_tensor():
    """The distributed optimizer's view: each TP rank's shard flattened, cut into DP ranges at
    arbitrary points; all pieces of all ranks tile the full tensor exactly."""
    full = torch.randn(24 + 12 + 12, 10)
    for tp in (1, 2, 4):
        for dp in (1, 3):
            pieces = []
            for t in range(tp):
                meta = _meta(full.shape, 0, (24, 12, 12), t, tp)
                flat = local_slice(full, meta).reshape(-1)
                bounds = [round(i * flat.numel() / dp) + (7 if 0 < i < dp else 0) for i in range(dp + 1)]
                for a, b in zip(bounds, bounds[1:]):
                    pieces += flat_boxes(flat[a:b], a, meta, meta.local_shape)
            out, count = _assemble(full.shape, pieces)
            assert torch.equal(out, full) and bool((count == 1).all()), (tp, dp)


def test_flat_boxes_are_views_so_loading_fills_in_place():
    meta = _meta((8, 4), 0, (4, 4), 1, 2)
    flat = torch.zeros(10)
    for offsets, view in flat_boxes(flat, 3, meta, meta.local_shape):
        view.fill_(1.0)
    assert flat.sum().item() == 10.0
