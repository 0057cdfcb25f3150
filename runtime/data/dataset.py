"""Training samples: fixed-length windows of a prepared token file, in a seeded order.

The token stream is split by weight (Megatron's --split "969,30,1": train, valid, test) into
contiguous ranges, so no window straddles two splits. A split of L tokens holds
(L - 1) // seq_length disjoint windows of seq_length + 1 tokens (input = window[:-1], labels =
window[1:]). Sample j of a split is window perm_e[j mod n], where perm_e is a permutation of the
n windows drawn from (seed, split, epoch e = j div n): every rank computes the same order without
communicating, and a run can resume from its consumed-sample count.

Each step consumes one global batch. Data-parallel rank r reads, for micro-batch m, the samples
consumed + (m * DP + r) * mbs ... + mbs - 1 and nothing else; with DP = 1 and DP times as many
micro-batches the global batch is the same set of samples. Tensor-parallel ranks of one DP rank
read the same samples.
"""

from __future__ import annotations

import numpy as np

from .errors import DataError
from .indexed import IndexedTokens

SPLITS = ("train", "valid", "test")


def split_ranges(num_tokens: int, weights) -> dict:
    """Token ranges per split for normalized weights (train, valid, test)."""
    bounds = [0]
    acc = 0.0
    for w in weights:
        acc += w
        bounds.append(min(num_tokens, int(round(acc * num_tokens))))
    bounds[-1] = num_tokens
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLITS)}


class TokenWindows:
    def __init__(self, data: IndexedTokens, token_range: tuple, seq_length: int, seed: int, split: str):
        self.data, self.seq_length, self.seed = data, seq_length, seed
        self.split_id = SPLITS.index(split)
        self.split = split
        self.lo, self.hi = token_range
        self.num_windows = max(0, (self.hi - self.lo - 1) // seq_length)
        self._perm_epoch = -1
        self._perm = None

    def __len__(self) -> int:
        return self.num_windows

    def window(self, k: int) -> np.ndarray:
        start = self.lo + k * self.seq_length
        return np.asarray(self.data.tokens[start:start + self.seq_length + 1], dtype=np.int64)

    def sample(self, j: int) -> np.ndarray:
        if self.num_windows == 0:
            raise DataError(f"the {self.split} split has no sample of {self.seq_length + 1} tokens")
        epoch, i = divmod(j, self.num_windows)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, self.split_id, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_windows), epoch
        return self.window(int(self._perm[i]))

    def micro_batch(self, consumed: int, micro: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        """(tokens, labels) int64 arrays [mbs, seq] for this DP rank's micro-batch `micro` of the
        global batch that starts at sample `consumed`."""
        first = consumed + (micro * dp_size + dp_rank) * micro_batch_size
        rows = np.stack([self.sample(first + i) for i in range(micro_batch_size)])
        return rows[:, :-1], rows[:, 1:]


def build_datasets(directory: str, seq_length: int, seed: int, weights) -> dict:
    """{'train': TokenWindows, 'valid': ..., 'test': ...} for a prepared dataset."""
    data = IndexedTokens(directory)
    ranges = split_ranges(data.num_tokens, weights)
    return {name: TokenWindows(data, ranges[name], seq_length, seed, name) for name in SPLITS}
