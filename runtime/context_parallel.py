"""Context parallelism (CP): the sequence split over the `cp` group, load-balanced.

The full sequence of S tokens is cut into 2N chunks of c = S / (2N) tokens (N = cp.size);
CP rank r holds chunks r and 2N-1-r, concatenated in that order (local length 2c). Under a
causal mask every rank then does the same attention work. A CP-sharded value is plain dim
sharding of this permuted sequence, so per-token ops need nothing; only position-dependent
ops (attention, rotary, learned positions) and the model's boundaries know the order.

Attention over the CP group (`context_parallel_attention`), two comm types:

* ``p2p`` (ring attention, Megatron's ``--cp-comm-type p2p``): K/V travel once around the
  ring in N-1 point-to-point steps, each overlapped with the current block's computation;
  block results are merged by log-sum-exp rescaling. Backward recomputes each block from the
  saved log-sum-exp (flash-attention's formulas), passes K/V around the ring again and the
  dK/dV accumulators one step behind them (N exchanges). With a causal mask no fully masked
  block is computed: step 0 is the local causal block (its first query chunk against its own
  chunk, the second against both: the chunk pair wholly masked is skipped); K/V from an earlier
  rank is seen by
  all local queries but only through its first chunk; K/V from a later rank is seen only by
  the second local query chunk, through both its chunks -- all without a mask. Under a sliding
  window or document ids each step's blocks are cut by chunk pairs instead: a (query chunk,
  key chunk) pair wholly outside the causal mask or the window is skipped (with W below the
  chunk length a query chunk meets at most two key chunks), the rest computed with a mask
  built from the global positions (and the documents); K/V still go all the way round.
* ``all_gather`` (Llama 3): K and V are all-gathered over CP (backward: dK and dV
  reduce-scattered); local queries attend to the whole sequence with a mask built from
  global positions. The gathered K/V stay in gathered (rank) order: softmax does not depend
  on the order of the keys, only the mask does, and it is built from their positions. It
  computes every (query, key) pair, masked ones included, and keeps the mask for backward.

Both take the masks CoreAttention takes at cp = 1, by global position: a sliding window, chunks,
ALiBi's bias, soft-capped scores (C * tanh(scores / C) before the mask; backward recomputes the tanh),
and document ids [b, S] of the whole sequence (every CP rank holds the model's inputs whole: the
queries' ids are looked up at the rank's positions, the keys' at theirs; nothing travels).

Only KV heads travel (GQA: num_kv_heads <= num_heads; query head i reads KV head
i // (num_heads / num_kv_heads)). Softmax and its statistics are computed in at least fp32;
the K/V and dK/dV messages are in the dtype of k.

Dropout: each rank draws one seed from torch's current generator (CoreAttention forks the
"tensor-parallel" stream around the call) and mixes in its CP rank, then draws every block's
keep-mask from a generator seeded with it, in a fixed block order; backward replays the same
generator, so no mask is stored. The masks therefore differ from a CP=1 run: dropout with CP
is verified statistically. With a TP-invariant RNGTracker (the debug mode of `specc verify`)
the mask of the FULL [b, heads, S, S] attention is drawn once and each rank keeps its heads,
query rows and key columns, so CP then drops exactly what CP=1 drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import comm
from .parallel_state import Group
from .sharding import chunk_pair, local_piece

COMM_TYPES = ("p2p", "all_gather")

# p2p tags: K/V and dK/dV messages between the same pair of ranks are matched separately.
_KV_TAG, _DKV_TAG = 11, 12


# ---------------------------------------------------------------------------
# The load-balanced order.


def load_balanced_positions(local_len: int, cp: Group, device=None) -> torch.Tensor:
    """The global positions (int64, [local_len]) of CP rank cp.rank's tokens: its chunk_pair."""
    return _positions(local_len, cp.size, cp.rank, device)


def _positions(local_len: int, n: int, rank: int, device=None) -> torch.Tensor:
    if n == 1:
        return torch.arange(local_len, device=device)
    if local_len % 2 != 0:
        raise ValueError(f"a context-parallel rank holds 2 chunks: its local length {local_len} must be even")
    c = local_len // 2
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in chunk_pair(n, rank)])


def _gathered_positions(local_len: int, n: int, device=None) -> torch.Tensor:
    """Positions of the tokens of an all-gather over CP (rank order)."""
    return torch.cat([_positions(local_len, n, r, device) for r in range(n)])


def split_load_balanced(x: torch.Tensor, cp: Group, dim: int) -> torch.Tensor:
    """This CP rank's two chunks of the natural-order `x` along `dim` (a copy)."""
    if cp.size == 1:
        return x
    n, size = cp.size, x.shape[dim]
    if size % (2 * n) != 0:
        raise ValueError(f"dim {dim} of size {size} is not divisible by 2 * cp size = {2 * n}")
    c = size // (2 * n)
    return torch.cat([x.narrow(dim, k * c, c) for k in chunk_pair(n, cp.rank)], dim=dim)


def gather_load_balanced(x: torch.Tensor, cp: Group, dim: int) -> torch.Tensor:
    """All-gather every CP rank's two chunks along `dim` and restore the natural order."""
    if cp.size == 1:
        return x
    n = cp.size
    if x.shape[dim] % 2 != 0:
        raise ValueError(f"a context-parallel rank holds 2 chunks: dim {dim} of size {x.shape[dim]} must be even")
    local = x.movedim(dim, 0).contiguous()
    gathered = local.new_empty((n * local.shape[0], *local.shape[1:]))
    comm.all_gather_into_tensor(gathered, local, cp)
    # Gathered chunk k is natural chunk order[k] (rank k // 2's chunks r, 2n-1-r).
    order = [c for r in range(n) for c in chunk_pair(n, r)]
    inverse = torch.tensor([order.index(j) for j in range(2 * n)], device=x.device)
    chunks = gathered.view(2 * n, local.shape[0] // 2, *local.shape[1:])
    natural = chunks.index_select(0, inverse).reshape(gathered.shape)
    return natural.movedim(0, dim).contiguous()


def get_batch_on_this_cp_rank(batch: dict, cp: Group) -> dict:
    """Megatron's name: slice every [b, s, ...] tensor of `batch` (tokens, labels, loss mask,
    position ids) to this CP rank's chunks along dim 1; None values pass through. A new dict."""
    if cp.size == 1:
        return dict(batch)
    return {key: None if t is None else split_load_balanced(t, cp, dim=1) for key, t in batch.items()}


# ---------------------------------------------------------------------------
# Attention.


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cp: Group,
    comm_type: str = "p2p",
    causal: bool = True,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    rng_tracker=None,
    tp: Group | None = None,
    window: int | None = None,
    softcap: float | None = None,
    document_ids: torch.Tensor | None = None,
    chunk: int | None = None, alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact softmax attention of this rank's load-balanced chunks against the full sequence.

    q [s_local, b, num_heads * head_dim], k and v [s_local, b, num_kv_heads * head_dim]
    (heads already TP-local, s_local = S / cp.size, even) -> [s_local, b, num_heads * head_dim]
    in q's dtype. Causal by global position, or bidirectional. `dropout_p` > 0 draws masks as
    the module docstring says; pass the RNGTracker (and tp) for its TP-invariant mode.

    Masks by global position, as CoreAttention's at cp = 1: `window` W keeps the keys j with
    i - W < j <= i (causal) or |i - j| < W (bidirectional); `softcap` C turns the scores into
    C * tanh(scores / C) before the mask; `document_ids` [b, S] -- the WHOLE sequence's, in
    natural order, as every CP rank holds the model's inputs -- keeps each query within its
    document (no gradient); `chunk` C keeps the keys of the query's own C positions (Llama 4);
    `alibi_slopes` [num_heads] (this rank's heads) adds slope_h * (j - i) to the scores.
    """
    if comm_type not in COMM_TYPES:
        raise ValueError(f"context-parallel comm type must be one of {COMM_TYPES}, got {comm_type!r}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dim() != 3:
        raise ValueError(f"q must be [s, b, {num_heads}*{head_dim}], got {tuple(q.shape)}")
    s, b = q.shape[0], q.shape[1]
    for what, t, n in (("q", q, num_heads), ("k", k, num_kv_heads), ("v", v, num_kv_heads)):
        if t.dim() != 3 or t.shape[0] != s or t.shape[1] != b or t.shape[2] != n * head_dim:
            raise ValueError(f"{what} must be [{s}, {b}, {n}*{head_dim}], got {tuple(t.shape)}")
    if s % 2 != 0:
        raise ValueError(f"a context-parallel rank holds 2 chunks: the local sequence length {s} must be even")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {dropout_p}")
    if window is not None and window < 1:
        raise ValueError(f"attention window must be >= 1 token, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"attention softcap must be > 0, got {softcap}")
    if document_ids is not None and tuple(document_ids.shape) != (b, s * cp.size):
        raise ValueError(f"document_ids must be the whole sequence's [b, S] = [{b}, {s * cp.size}] on every CP "
                         f"rank, got {tuple(document_ids.shape)}")
    cfg = _Config(
        cp=cp, causal=causal, heads=num_heads, kv_heads=num_kv_heads, head_dim=head_dim,
        scale=1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale),
        dropout=_dropout_for(q, dropout_p, cp, rng_tracker, tp or Group.single("tp"), num_heads, num_kv_heads),
        window=window, softcap=None if softcap is None else float(softcap),
        document_ids=None if document_ids is None else document_ids.detach(), chunk=chunk,
        alibi=None if alibi_slopes is None else alibi_slopes.detach().reshape(num_kv_heads, num_heads // num_kv_heads),
    )
    fn = _RingAttention if comm_type == "p2p" else _AllGatherAttention
    return fn.apply(q, k, v, cfg)


@dataclass
class _Config:
    cp: Group
    causal: bool
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    dropout: _BlockDropout
    window: int | None = None
    softcap: float | None = None
    document_ids: torch.Tensor | None = None  # [b, S], natural order
    chunk: int | None = None
    alibi: torch.Tensor | None = None  # [G, g] slopes of the local query heads

    @property
    def masks_by_position(self) -> bool:
        """A mask (or bias) beyond the plain causal one: the ring then builds one per block."""
        return any(x is not None for x in (self.window, self.document_ids, self.chunk, self.alibi))

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype):  # ALiBi's slope_h * (j - i): [G, g, sq, sk]
        diff = None if self.alibi is None else (k_pos.unsqueeze(0) - q_pos.unsqueeze(1)).to(dtype)
        return None if diff is None else self.alibi.to(dtype)[:, :, None, None] * diff


class _BlockDropout:
    """Keep-masks per attention block, drawn again identically in backward (see the module
    docstring). Blocks are [b, kv_heads, group, rows, cols]."""

    def __init__(self, p: float, seed: int | None, full_rows: torch.Tensor | None, device):
        self.p, self.seed, self.full_rows, self.device = p, seed, full_rows, device
        self._gen = None

    def restart(self) -> None:
        if self.seed is not None:
            self._gen = torch.Generator(device=self.device).manual_seed(self.seed)

    def keep(self, shape, rows: slice, key_positions: torch.Tensor) -> torch.Tensor | None:
        if self.p == 0.0:
            return None
        if self.full_rows is not None:  # TP-invariant: [b, G, g, s_local, S] -> this block's columns
            return self.full_rows[..., rows, :].index_select(-1, key_positions)
        return torch.rand(shape, generator=self._gen, device=self.device) >= self.p


def _dropout_for(q, p: float, cp: Group, rng_tracker, tp: Group, heads: int, kv_heads: int) -> _BlockDropout:
    if p == 0.0:
        return _BlockDropout(0.0, None, None, q.device)
    if rng_tracker is not None and rng_tracker.tp_invariant:
        s_local, b = q.shape[0], q.shape[1]
        full_len = s_local * cp.size
        full = rng_tracker.full_keep_mask((b, heads * tp.size, full_len, full_len), p, q.device)
        mine = local_piece(full, "S(h)", tp, dim_for_heads=1)
        rows = mine.index_select(2, load_balanced_positions(s_local, cp, q.device))
        rows = rows.reshape(b, kv_heads, heads // kv_heads, s_local, full_len)
        return _BlockDropout(p, None, rows, q.device)
    seed = int(torch.randint(0, 2**62, (1,)).item()) + cp.rank  # the current (forked) stream
    return _BlockDropout(p, seed, None, q.device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _q_heads(x: torch.Tensor, cfg: _Config, dtype) -> torch.Tensor:
    """[s, b, nh*d] -> [b, G, g, s, d] (G kv heads, g query heads per kv head)."""
    s, b = x.shape[:2]
    g = cfg.heads // cfg.kv_heads
    return x.reshape(s, b, cfg.kv_heads, g, cfg.head_dim).permute(1, 2, 3, 0, 4).to(dtype)


def _kv_heads(x: torch.Tensor, cfg: _Config, dtype) -> torch.Tensor:
    """[s, b, G*d] -> [b, G, 1, s, d] (broadcast over the query heads of each kv head)."""
    s, b = x.shape[:2]
    return x.reshape(s, b, cfg.kv_heads, cfg.head_dim).permute(1, 2, 0, 3).unsqueeze(2).to(dtype)


def _from_q_heads(x: torch.Tensor, dtype) -> torch.Tensor:
    b, big_g, g, s, d = x.shape
    return x.permute(3, 0, 1, 2, 4).reshape(s, b, big_g * g * d).to(dtype)


def _from_kv_heads(x: torch.Tensor, dtype) -> torch.Tensor:
    """[b, G, s, d] -> [s, b, G*d]."""
    b, big_g, s, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(s, b, big_g * d).to(dtype)


def _block_forward(q, k, v, scale, masked, keep, p, softcap=None, empty_rows=False, bias=None):
    """One block: q [b,G,g,sq,d], k/v [b,G,1,sk,d] -> (out [b,G,g,sq,d], lse [b,G,g,sq]).
    `empty_rows`: the mask may hide every key of a row (a window, documents): its lse is -inf
    and its output 0, not NaN."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:  # Gemma 2: C * tanh(scores / C), before the mask
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:  # ALiBi
        scores = scores + bias
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - (_finite(lse) if empty_rows else lse).unsqueeze(-1))
    if keep is not None:
        probs = probs * keep.to(probs.dtype) * (1.0 / (1.0 - p))
    return torch.matmul(probs, v), lse


def _block_backward(q, k, v, dout, lse, delta, scale, masked, keep, p, softcap=None, bias=None):
    """Flash-attention backward of one block from the FINAL lse and delta = rowsum(dout * out):
    returns dq [b,G,g,sq,d], dk and dv [b,G,sk,d]. (Every row's final lse is finite: a query
    always sees its own position.)"""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    if bias is not None:  # a constant: nothing flows back through it
        scores = scores + bias
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))  # the block's part of the full softmax
    dprobs = torch.matmul(dout, v.transpose(-1, -2))
    if keep is not None:
        factor = keep.to(probs.dtype) * (1.0 / (1.0 - p))
        dropped, dprobs = probs * factor, dprobs * factor
    else:
        dropped = probs
    dv = torch.matmul(dropped.transpose(-1, -2), dout).sum(2)
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    if capped is not None:  # d/dx C tanh(x / C) = 1 - tanh^2
        dscores = dscores * (1.0 - capped * capped)
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q).sum(2)
    return dq, dk, dv


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that sees no key) as 0, so exp(scores - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _ring_block(step: int, rank: int, n: int, local_len: int, causal: bool, device=None) -> list:
    """[(query rows, kv rows, mask)] of ring step `step` under the plain causal mask (or none),
    whose K/V come from rank - step."""
    everything = slice(0, local_len)
    if not causal:
        return [(everything, everything, None)]
    half = local_len // 2
    if step == 0:  # local chunks in increasing position order: the first sees only itself, causally;
        # the second all of the first and itself causally (the pair first x second is all masked: skipped)
        diagonal = torch.ones(half, half, dtype=torch.bool, device=device).triu(1)
        return [(slice(0, half), slice(0, half), diagonal),
                (slice(half, local_len), everything, torch.cat([torch.zeros_like(diagonal), diagonal], dim=1))]
    if step <= rank:  # K/V from an earlier rank: only its first chunk is in anyone's past
        return [(everything, slice(0, half), None)]
    return [(slice(half, local_len), everything, None)]  # later rank: only our second chunk sees it


# How a mask treats a (query chunk, key chunk) pair of the ring: no pair kept, every pair kept,
# or some (the block is computed with a mask). specc/ops/attention.py counts FLOPs by the same rule.
SKIP, FULL, PARTIAL = "skip", "full", "partial"


def chunk_pair_kind(q_start: int, k_start: int, c: int, causal: bool, window: int | None) -> str:
    """SKIP, FULL or PARTIAL for queries at global positions [q_start, q_start + c) against keys
    [k_start, k_start + c) under the causal mask and/or a window (i - W < j <= i causal,
    |i - j| < W bidirectional); documents are data, never skipped on."""
    lo, hi = q_start - (k_start + c - 1), q_start + c - 1 - k_start  # the least and largest i - j
    if causal:
        if hi < 0:
            return SKIP
        nearest, farthest, full = max(lo, 0), hi, lo >= 0
    else:
        nearest = 0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
        farthest, full = max(abs(lo), abs(hi)), True
    if window is not None:
        if nearest >= window:
            return SKIP
        full = full and farthest < window
    return FULL if full else PARTIAL


def _ring_blocks(step: int, rank: int, n: int, local_len: int, causal: bool, window: int | None) -> list:
    """[(query rows, kv rows, partial)] that ring step `step` computes under a window or
    documents: chunk pairs wholly outside the mask are skipped (with W much smaller than the
    chunk, a query chunk meets one or two key chunks of the 2N); a query chunk's kept key
    chunks form one block, and the two query chunks one block when they keep the same."""
    c = local_len // 2
    src = (rank - step) % n
    q_starts, k_starts = (rank * c, (2 * n - 1 - rank) * c), (src * c, (2 * n - 1 - src) * c)
    halves = (slice(0, c), slice(c, local_len))
    per_row = []
    for q_start in q_starts:
        kinds = [chunk_pair_kind(q_start, k_start, c, causal, window) for k_start in k_starts]
        kept = tuple(i for i in (0, 1) if kinds[i] != SKIP)
        per_row.append((kept, any(kinds[i] == PARTIAL for i in kept)))

    def cols(kept):
        return slice(0, local_len) if len(kept) == 2 else halves[kept[0]]

    (kept0, partial0), (kept1, partial1) = per_row
    if kept0 == kept1:
        return [(slice(0, local_len), cols(kept0), partial0 or partial1)] if kept0 else []
    return [(halves[i], cols(kept), partial) for i, (kept, partial) in enumerate(per_row) if kept]


def _block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, cfg: _Config, by_position: bool):
    """True where a query may not see a key: [sq, sk] from the global positions (when
    `by_position`: the causal mask, the window), | [b, 1, 1, sq, sk] across documents; None
    when nothing is masked."""
    masked = None
    if by_position and (cfg.causal or cfg.window is not None):
        diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)
        if cfg.causal:
            masked = diff < 0
        if cfg.window is not None:
            far = (diff if cfg.causal else diff.abs()) >= cfg.window
            masked = far if masked is None else masked | far
    if by_position and cfg.chunk is not None:
        other = (q_pos // cfg.chunk).unsqueeze(1) != (k_pos // cfg.chunk).unsqueeze(0)
        masked = other if masked is None else masked | other
    if cfg.document_ids is not None:
        docs = cfg.document_ids
        other = (docs[:, q_pos].unsqueeze(2) != docs[:, k_pos].unsqueeze(1))[:, None, None]
        masked = other if masked is None else masked | other
    return masked


def _step_blocks(step: int, cfg: _Config, s: int, q_pos: torch.Tensor, device, dtype) -> list:
    """[(query rows, kv rows, mask, bias)] of one ring step (a chunk pair kept whole may be cut by chunks)."""
    n, rank = cfg.cp.size, cfg.cp.rank
    if not cfg.masks_by_position:
        return [(*block, None) for block in _ring_block(step, rank, n, s, cfg.causal, device)]
    k_pos = _positions(s, n, (rank - step) % n, device)
    return [(rows, cols, _block_mask(q_pos[rows], k_pos[cols], cfg, partial or cfg.chunk is not None),
             cfg.bias(q_pos[rows], k_pos[cols], dtype))
            for rows, cols, partial in _ring_blocks(step, rank, n, s, cfg.causal, cfg.window)]


def _wait(works) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _saved_output(ctx, out: torch.Tensor, result: torch.Tensor) -> tuple:
    """What backward keeps of the attention output: the returned [s, b, nh*d] tensor itself when
    it holds the compute dtype (the projection after attention saves that tensor too, so it is
    one storage, as the plan counts it), else the compute-dtype [b, G, g, s, d] output."""
    ctx.output_is_result = result.dtype == out.dtype
    return (result if ctx.output_is_result else out,)


def _output_heads(ctx, saved: torch.Tensor, cfg: _Config, dtype) -> torch.Tensor:
    return _q_heads(saved, cfg, dtype) if ctx.output_is_result else saved


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: _Config):
        cp, n, rank = cfg.cp, cfg.cp.size, cfg.cp.rank
        s = q.shape[0]
        dtype = _compute_dtype(q.dtype)
        q5 = _q_heads(q, cfg, dtype)
        kv = torch.stack([k, v])  # one message per step: [2, s, b, G*d]
        cfg.dropout.restart()
        out = lse = None
        empty_rows = cfg.masks_by_position  # a block may hide every key of a row
        q_pos = load_balanced_positions(s, cp, q.device) if cfg.masks_by_position else None
        if empty_rows:  # blocks cover only some rows: merge every one into an empty result
            out = torch.zeros(q5.shape, dtype=dtype, device=q.device)
            lse = torch.full(q5.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        for step in range(n):
            works, incoming = [], None
            if step < n - 1:  # start the next block's transfer; it runs during this block
                incoming = torch.empty_like(kv)
                works = comm.ring_exchange(kv, incoming, cp, tag=_KV_TAG)
            for rows, cols, masked, bias in _step_blocks(step, cfg, s, q_pos, q.device, dtype):
                qb = q5[..., rows, :]
                keep = cfg.dropout.keep((*qb.shape[:-1], cols.stop - cols.start), rows,
                                        _positions(s, n, (rank - step) % n, q.device)[cols])
                block_out, block_lse = _block_forward(qb, _kv_heads(kv[0, cols], cfg, dtype),
                                                      _kv_heads(kv[1, cols], cfg, dtype), cfg.scale,
                                                      masked, keep, cfg.dropout.p, cfg.softcap, empty_rows, bias)
                if out is None:  # the plain ring's step 0: its blocks cover each row exactly once
                    out = torch.empty(q5.shape, dtype=dtype, device=q.device)
                    lse = torch.empty(q5.shape[:-1], dtype=dtype, device=q.device)
                if step == 0 and not empty_rows:
                    out[..., rows, :], lse[..., rows] = block_out, block_lse
                else:
                    old_out, old_lse = out[..., rows, :], lse[..., rows]
                    new_lse = torch.logaddexp(old_lse, block_lse)
                    ref = _finite(new_lse) if empty_rows else new_lse
                    out[..., rows, :] = (old_out * torch.exp(old_lse - ref).unsqueeze(-1)
                                         + block_out * torch.exp(block_lse - ref).unsqueeze(-1))
                    lse[..., rows] = new_lse
            _wait(works)
            if incoming is not None:
                kv = incoming
        ctx.cfg = cfg
        result = _from_q_heads(out, q.dtype)
        ctx.save_for_backward(q, k, v, *_saved_output(ctx, out, result), lse)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        cp, n, rank = cfg.cp, cfg.cp.size, cfg.cp.rank
        s = q.shape[0]
        dtype = _compute_dtype(q.dtype)
        out = _output_heads(ctx, out, cfg, dtype)
        need_kv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        q5, dout5 = _q_heads(q, cfg, dtype), _q_heads(dout, cfg, dtype)
        delta = (dout5 * out).sum(-1)
        dq = torch.zeros(out.shape, dtype=dtype, device=out.device)
        kv = torch.stack([k, v])
        dkv = None  # the accumulated dK/dV of the block held in the previous step
        q_pos = load_balanced_positions(s, cp, q.device) if cfg.masks_by_position else None
        cfg.dropout.restart()
        for step in range(n):
            works, incoming, dkv_in = [], None, None
            if step < n - 1:
                incoming = torch.empty_like(kv)
                works += comm.ring_exchange(kv, incoming, cp, tag=_KV_TAG)
            if need_kv and step > 0:  # pass the previous block's dK/dV on; receive this block's
                dkv_in = torch.empty_like(dkv)
                works += comm.ring_exchange(dkv, dkv_in, cp, tag=_DKV_TAG)
            block_dkv = torch.zeros_like(kv) if need_kv else None
            for rows, cols, masked, bias in _step_blocks(step, cfg, s, q_pos, q.device, dtype):
                qb = q5[..., rows, :]
                keep = cfg.dropout.keep((*qb.shape[:-1], cols.stop - cols.start), rows,
                                        _positions(s, n, (rank - step) % n, q.device)[cols])
                dq_b, dk_b, dv_b = _block_backward(qb, _kv_heads(kv[0, cols], cfg, dtype),
                                                   _kv_heads(kv[1, cols], cfg, dtype), dout5[..., rows, :],
                                                   lse[..., rows], delta[..., rows], cfg.scale, masked, keep,
                                                   cfg.dropout.p, cfg.softcap, bias)
                dq[..., rows, :] += dq_b
                if need_kv:
                    block_dkv[0, cols] += _from_kv_heads(dk_b, k.dtype)
                    block_dkv[1, cols] += _from_kv_heads(dv_b, k.dtype)
            _wait(works)
            if need_kv:
                dkv = block_dkv if dkv_in is None else block_dkv.add_(dkv_in)
            if incoming is not None:
                kv = incoming
        dk = dv = None
        if need_kv:
            if n > 1:  # the last block held is rank+1's: its dK/dV go home
                own = torch.empty_like(dkv)
                _wait(comm.ring_exchange(dkv, own, cp, tag=_DKV_TAG))
                dkv = own
            dk, dv = dkv[0], dkv[1]
        return _from_q_heads(dq, q.dtype), dk, dv, None


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg: _Config):
        cp, n = cfg.cp, cfg.cp.size
        s = q.shape[0]
        dtype = _compute_dtype(q.dtype)
        k_all = k.new_empty((n * s, *k.shape[1:]))
        v_all = v.new_empty((n * s, *v.shape[1:]))
        works = [comm.all_gather_into_tensor(k_all, k.contiguous(), cp, async_op=True),
                 comm.all_gather_into_tensor(v_all, v.contiguous(), cp, async_op=True)]
        q5 = _q_heads(q, cfg, dtype)
        key_positions = _gathered_positions(s, n, q.device)
        masked = bias = None
        if cfg.masks_by_position:
            q_pos = load_balanced_positions(s, cp, q.device)
            masked, bias = _block_mask(q_pos, key_positions, cfg, True), cfg.bias(q_pos, key_positions, dtype)
        elif cfg.causal:
            masked = key_positions.unsqueeze(0) > load_balanced_positions(s, cp, q.device).unsqueeze(1)
        _wait(works)
        cfg.dropout.restart()
        keep = cfg.dropout.keep((*q5.shape[:-1], n * s), slice(0, s), key_positions)
        # every query sees its own position among all keys: no row is empty
        out, lse = _block_forward(q5, _kv_heads(k_all, cfg, dtype), _kv_heads(v_all, cfg, dtype),
                                  cfg.scale, masked, keep, cfg.dropout.p, cfg.softcap, bias=bias)
        ctx.cfg, ctx.masked, ctx.bias = cfg, masked, bias
        result = _from_q_heads(out, q.dtype)
        ctx.save_for_backward(q, k_all, v_all, *_saved_output(ctx, out, result), lse)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        s, dtype = q.shape[0], _compute_dtype(q.dtype)
        out = _output_heads(ctx, out, cfg, dtype)
        q5, dout5 = _q_heads(q, cfg, dtype), _q_heads(dout, cfg, dtype)
        delta = (dout5 * out).sum(-1)
        cfg.dropout.restart()
        keep = cfg.dropout.keep((*q5.shape[:-1], k_all.shape[0]), slice(0, s),
                                _gathered_positions(s, cfg.cp.size, q.device))
        dq, dk_all, dv_all = _block_backward(q5, _kv_heads(k_all, cfg, dtype), _kv_heads(v_all, cfg, dtype),
                                             dout5, lse, delta, cfg.scale, ctx.masked, keep, cfg.dropout.p,
                                             cfg.softcap, ctx.bias)
        dk = dv = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            full_dk = _from_kv_heads(dk_all, k_all.dtype).contiguous()  # a view when there is one kv head
            full_dv = _from_kv_heads(dv_all, v_all.dtype).contiguous()
            dk = full_dk.new_empty((s, *full_dk.shape[1:]))
            dv = full_dv.new_empty((s, *full_dv.shape[1:]))
            _wait([comm.reduce_scatter_tensor(dk, full_dk, cfg.cp, async_op=True),
                   comm.reduce_scatter_tensor(dv, full_dv, cfg.cp, async_op=True)])
        return _from_q_heads(dq, q.dtype), dk, dv, None
