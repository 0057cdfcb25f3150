"""The public API generated modules import, and a whole TP=1 model without torch.distributed."""

import torch
import torch.distributed as dist
from torch import nn

import runtime as rt

CONTRACT = """
Group ProcessGroups all_reduce all_gather_into_tensor reduce_scatter_tensor CommCounter
copy_to_tensor_model_parallel_region reduce_from_tensor_model_parallel_region
gather_from_sequence_parallel_region reduce_scatter_to_sequence_parallel_region
scatter_to_sequence_parallel_region gather_from_tensor_model_parallel_region
scatter_to_tensor_model_parallel_region ColumnParallelLinear RowParallelLinear
VocabParallelEmbedding PositionEmbedding LayerNorm RMSNorm RotaryEmbedding CoreAttention Dropout
gelu swiglu split vocab_parallel_cross_entropy init_parameters full_parameter gather_full
RNGTracker mark_tp_partial_grad finalize_model_grads
""".split()


def test_contract_names_are_exported():
    missing = [name for name in CONTRACT if not hasattr(rt, name)]
    assert missing == []
    assert set(CONTRACT) <= set(rt.__all__)


class TinyGPT(nn.Module):
    """What a generated module looks like at TP=1: every boundary is an identity."""

    def __init__(self, pg, rng, vocab=32, h=16, heads=4, ffn=32, seq=8):
        super().__init__()
        tp = pg.tp
        self.tp, self.heads, self.head_dim = tp, heads // tp.size, h // heads
        self.embedding = rt.VocabParallelEmbedding(vocab, h, tp=tp)
        self.position = rt.PositionEmbedding(seq, h)
        self.dropout = rt.Dropout(0.1, rng_tracker=rng)
        self.ln1 = rt.LayerNorm(h)
        self.qkv = rt.ColumnParallelLinear(h, 3 * h, tp=tp, segments=[h, h, h], input_mode="copy")
        self.attn = rt.CoreAttention(self.heads, self.heads, self.head_dim, dropout=0.1, rng_tracker=rng)
        self.proj = rt.RowParallelLinear(h, h, tp=tp, init_std=0.01)
        self.ln2 = rt.LayerNorm(h)
        self.fc1 = rt.ColumnParallelLinear(h, ffn, tp=tp, input_mode="copy")
        self.fc2 = rt.RowParallelLinear(ffn, h, tp=tp)
        self.ln_f = rt.LayerNorm(h)
        self.output = rt.ColumnParallelLinear(h, vocab, tp=tp, bias=False, input_mode="copy",
                                              weight=self.embedding.weight)

    def forward(self, tokens, labels):
        x = rt.reduce_from_tensor_model_parallel_region(self.embedding(tokens), self.tp)
        x = self.dropout(x + self.position(tokens))
        q, k, v = rt.split(self.qkv(self.ln1(x)), [self.heads * self.head_dim] * 3)
        x = x + rt.reduce_from_tensor_model_parallel_region(self.proj(self.attn(q, k, v)), self.tp) + self.proj.bias
        h = rt.gelu(self.fc1(self.ln2(x)))
        x = x + rt.reduce_from_tensor_model_parallel_region(self.fc2(h), self.tp) + self.fc2.bias
        logits = self.output(self.ln_f(x))
        return rt.vocab_parallel_cross_entropy(logits, labels, self.tp).mean()


def test_tp1_model_trains_without_distributed():
    assert not dist.is_initialized()
    pg = rt.ProcessGroups.single()
    model = TinyGPT(pg, rt.RNGTracker(seed=0, tp_rank=0))
    rt.init_parameters(model, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (4, 8), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    losses = []
    with rt.CommCounter() as counter:
        for _ in range(20):
            optimizer.zero_grad()
            loss = model(tokens, labels)
            loss.backward()
            rt.finalize_model_grads(model, pg)
            optimizer.step()
            losses.append(loss.item())
    assert counter.totals() == {}  # TP=1: no collective at all
    assert abs(losses[0] - torch.log(torch.tensor(32.0)).item()) < 0.1  # starts near uniform
    assert losses[-1] < losses[0] - 1.0, losses  # it learns the batch
