import pytest
import torch

from runtime.random import RNGTracker


def draw(tracker, stream, n=8):
    with tracker.fork(stream):
        return torch.rand(n)


def test_default_stream_is_shared_and_tp_stream_is_per_rank():
    rank0, rank1 = RNGTracker(seed=42, tp_rank=0), RNGTracker(seed=42, tp_rank=1)
    assert torch.equal(draw(rank0, "default"), draw(rank1, "default"))
    assert not torch.equal(draw(rank0, "tensor-parallel"), draw(rank1, "tensor-parallel"))
    # Megatron's seeding: default from seed, tensor-parallel from seed + 2718 + tp_rank.
    assert torch.equal(draw(RNGTracker(7, 0), "default"), torch.rand(8, generator=torch.Generator().manual_seed(7)))
    expected = torch.rand(8, generator=torch.Generator().manual_seed(7 + 2718 + 3))
    assert torch.equal(draw(RNGTracker(7, 3), "tensor-parallel"), expected)


def test_streams_advance_and_restore_torch_state():
    tracker = RNGTracker(seed=1, tp_rank=0)
    torch.manual_seed(123)
    outside_before = torch.rand(4)
    torch.manual_seed(123)
    first = draw(tracker, "default")
    outside_after = torch.rand(4)
    assert torch.equal(outside_before, outside_after)  # the fork did not consume torch's stream
    second = draw(tracker, "default")
    assert not torch.equal(first, second)  # the stream advanced
    fresh = RNGTracker(seed=1, tp_rank=0)
    assert torch.equal(torch.cat([draw(fresh, "default"), draw(fresh, "default")]), torch.cat([first, second]))


def test_state_restored_when_the_block_raises():
    tracker = RNGTracker(seed=1, tp_rank=0)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="inside"):
        with tracker.fork("default"):
            torch.rand(3)
            raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), state)
    draw(tracker, "default")  # the stream is usable again


def test_nested_forks():
    tracker = RNGTracker(seed=1, tp_rank=0)
    with tracker.fork("default"):
        with tracker.fork("tensor-parallel"):
            inner = torch.rand(4)
        outer = torch.rand(4)
        with pytest.raises(RuntimeError, match="already forked"):
            with tracker.fork("default"):
                pass
    fresh = RNGTracker(seed=1, tp_rank=0)
    assert torch.equal(inner, draw(fresh, "tensor-parallel", n=4))
    assert torch.equal(outer, draw(fresh, "default", n=4))


def test_checkpoint_round_trip_and_errors():
    tracker = RNGTracker(seed=9, tp_rank=2)
    draw(tracker, "tensor-parallel")
    saved = tracker.get_states()
    expected = draw(tracker, "tensor-parallel")
    draw(tracker, "default")
    tracker.set_states(saved)
    assert torch.equal(draw(tracker, "tensor-parallel"), expected)
    with pytest.raises(KeyError, match="unknown RNG stream 'expert'"):
        draw(tracker, "expert")
    tracker.add("expert", 5)
    assert torch.equal(draw(tracker, "expert"), torch.rand(8, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("default", 1)


def test_streams_differ_per_context_parallel_rank():
    """CP ranks hold other tokens of the same samples: their dropout masks are independent (both
    streams), while TP ranks of one CP rank still share the default stream. CP rank 0 keeps the
    seeds of a run without CP."""
    from runtime.layers import Dropout

    assert torch.equal(draw(RNGTracker(7, 1, cp_rank=0), "tensor-parallel"), draw(RNGTracker(7, 1), "tensor-parallel"))
    assert torch.equal(draw(RNGTracker(7, 0, cp_rank=1), "default"), draw(RNGTracker(7, 1, cp_rank=1), "default"))
    keeps = {}
    for cp_rank in (0, 1):
        for stream in ("default", "tensor-parallel"):
            drop = Dropout(0.5, rng_tracker=RNGTracker(7, 0, cp_rank=cp_rank), stream=stream).train()
            keeps[cp_rank, stream] = drop(torch.ones(4096)) != 0
    for stream in ("default", "tensor-parallel"):
        # Independent masks at p = 0.5 agree on half the positions (sd 0.008 for 4096; 6 sd
        # either side); masks shared between CP ranks would agree everywhere.
        agree = (keeps[0, stream] == keeps[1, stream]).float().mean().item()
        assert 0.45 < agree < 0.55, (stream, agree)
