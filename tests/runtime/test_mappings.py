"""Each boundary's forward and backward on gloo ranks vs single-process math.

Every rank builds the same full tensors from fixed seeds, so it can compute the
expected local value and gradient by slicing.
"""

import pytest
import torch
import torch.distributed as dist

from runtime import mappings as m
from runtime.parallel_state import Group

S, B, H = 8, 2, 12  # S and H divisible by 2 and 4


def world_group(rank, world):
    return Group(size=world, rank=rank, group=dist.group.WORLD, ranks=tuple(range(world)), name="tp")


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rows(x, rank, world):
    return x.chunk(world, dim=0)[rank]


def cols(x, rank, world):
    return x.chunk(world, dim=-1)[rank]


def run_boundary(fn, x_local, grad_out):
    """y = fn(x); backward with grad_out; returns (y, x.grad)."""
    x = x_local.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad_out)
    return y.detach(), x.grad


def _check_all_mappings(rank, world):
    g = world_group(rank, world)
    full = seeded(1, S, B, H)  # a value that is the same on every rank
    per_rank = [seeded(10 + r, S, B, H) for r in range(world)]  # rank-divergent values
    grad_full = seeded(2, S, B, H)
    grad_per_rank = [seeded(20 + r, S, B, H) for r in range(world)]
    mine, grad_mine = per_rank[rank], grad_per_rank[rank]
    close = torch.testing.assert_close

    # I -> R: identity; the gradient is partial on each rank, summed.
    y, dx = run_boundary(lambda x: m.copy_to_tensor_model_parallel_region(x, g), full, grad_mine)
    close(y, full)
    close(dx, sum(grad_per_rank))

    # P -> I: the sum over ranks; the gradient is already complete.
    y, dx = run_boundary(lambda x: m.reduce_from_tensor_model_parallel_region(x, g), mine, grad_full)
    close(y, sum(per_rank))
    close(dx, grad_full)

    # S(s) -> R: all-gather; partial gradients reduce-scattered.
    y, dx = run_boundary(lambda x: m.gather_from_sequence_parallel_region(x, g), rows(full, rank, world), grad_mine)
    close(y, full)
    close(dx, rows(sum(grad_per_rank), rank, world))

    # S(s) -> I: all-gather; the complete gradient is just split.
    y, dx = run_boundary(
        lambda x: m.gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=False),
        rows(full, rank, world), grad_full,
    )
    close(y, full)
    close(dx, rows(grad_full, rank, world))

    # P -> S(s): reduce-scatter; the gradient all-gathered.
    y, dx = run_boundary(
        lambda x: m.reduce_scatter_to_sequence_parallel_region(x, g), mine, rows(grad_full, rank, world)
    )
    close(y, rows(sum(per_rank), rank, world))
    close(dx, grad_full)

    # I -> S(s): keep own rows; the gradient all-gathered.
    y, dx = run_boundary(lambda x: m.scatter_to_sequence_parallel_region(x, g), full, rows(grad_full, rank, world))
    close(y, rows(full, rank, world))
    close(dx, grad_full)

    # S(h) -> I: all-gather the last dim; the gradient split on the last dim.
    y, dx = run_boundary(lambda x: m.gather_from_tensor_model_parallel_region(x, g), cols(full, rank, world), grad_full)
    close(y, full)
    close(dx, cols(grad_full, rank, world))

    # I -> S(h): keep own columns; the gradient all-gathered on the last dim.
    y, dx = run_boundary(lambda x: m.scatter_to_tensor_model_parallel_region(x, g), full, cols(grad_full, rank, world))
    close(y, cols(full, rank, world))
    close(dx, grad_full)

    # Fused values ([q | k | v], segments of full sizes): each rank holds a slice of every segment.
    segs = [8, 4]  # uneven, each divisible by 2 and 4
    assert sum(segs) == H

    def by_segment(x):
        return torch.cat([cols(p, rank, world) for p in x.split(segs, dim=-1)], dim=-1)

    assert not torch.equal(by_segment(full), cols(full, rank, world))  # the cut matters
    y, dx = run_boundary(lambda x: m.gather_from_tensor_model_parallel_region(x, g, segments=segs),
                         by_segment(full), grad_full)
    close(y, full)
    close(dx, by_segment(grad_full))
    y, dx = run_boundary(lambda x: m.scatter_to_tensor_model_parallel_region(x, g, segments=segs),
                         full, by_segment(grad_full))
    close(y, by_segment(full))
    close(dx, grad_full)


def _check_inputs_and_shared_grads_untouched(rank, world):
    g = world_group(rank, world)
    # The forward all-reduce must not write into its input.
    x = seeded(10 + rank, S, B, H)
    before = x.clone()
    m.reduce_from_tensor_model_parallel_region(x, g)
    assert torch.equal(x, before)

    # Addition hands the SAME gradient tensor to both branches: the backward
    # all-reduce of one branch must not corrupt the other's gradient.
    a = seeded(1, S, B, H).requires_grad_(True)
    b = seeded(2, S, B, H).requires_grad_(True)
    grad = seeded(20 + rank, S, B, H)
    (m.copy_to_tensor_model_parallel_region(a, g) + b).backward(grad)
    torch.testing.assert_close(b.grad, grad)
    torch.testing.assert_close(a.grad, sum(seeded(20 + r, S, B, H) for r in range(world)))


def _check_indivisible_sizes_raise(rank, world):
    g = world_group(rank, world)
    odd = torch.randn(world + 1, B, world + 1)
    for fn in (
        m.reduce_scatter_to_sequence_parallel_region,
        m.scatter_to_sequence_parallel_region,
    ):
        with pytest.raises(ValueError, match=r"dim 0 of size \d+ is not divisible by the 'tp' group size"):
            fn(odd, g)
    with pytest.raises(ValueError, match="the last dim of size"):
        m.scatter_to_tensor_model_parallel_region(odd, g)


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_and_backward(gloo, world):
    gloo.run(world, _check_all_mappings)
    gloo.run(world, _check_inputs_and_shared_grads_untouched)
    gloo.run(world, _check_indivisible_sizes_raise)


def test_size_one_mappings_are_identity_without_distributed():
    assert not dist.is_initialized()
    g = Group.single("tp")
    x = torch.randn(3, 2, 5, requires_grad=True)
    for fn in (
        m.copy_to_tensor_model_parallel_region,
        m.reduce_from_tensor_model_parallel_region,
        m.gather_from_sequence_parallel_region,
        m.reduce_scatter_to_sequence_parallel_region,
        m.scatter_to_sequence_parallel_region,
        m.gather_from_tensor_model_parallel_region,
        m.scatter_to_tensor_model_parallel_region,
    ):
        assert fn(x, g) is x, fn.__name__
