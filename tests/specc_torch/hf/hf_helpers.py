"""Small random Hugging Face models built from a config (no download) that match the tiny specs,
and the compiled models' logits, here and in spawned gloo ranks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import runtime
import specc_torch
from runtime.parallel_state import ProcessGroups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SPECS = {family: os.path.join(ROOT, "specs", f"{family}-tiny.yaml") for family in ("gpt", "llama", "gemma", "olmo2", "qwen3", "starcoder2")}

# The transformers config of each specs/<family>-tiny.yaml: (config class, its arguments).
_DECODER = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
                num_hidden_layers=2, vocab_size=256, max_position_embeddings=32)
CONFIGS = {
    "gpt": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32, n_inner=256,
                               activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama": ("LlamaConfig", dict(_DECODER, rms_norm_eps=1e-5)),
    "gemma": ("GemmaConfig", dict(_DECODER, head_dim=16, rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "olmo2": ("Olmo2Config", dict(_DECODER, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                  pad_token_id=0, eos_token_id=1)),
    "qwen3": ("Qwen3Config", dict(_DECODER, head_dim=16, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "starcoder2": ("Starcoder2Config", dict(_DECODER, intermediate_size=256, norm_epsilon=1e-5, use_bias=True, bos_token_id=0, eos_token_id=0,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def hf_config(family: str, **changes):
    """The transformers config of specs/<family>-tiny.yaml, with `changes`."""
    import transformers

    name, kw = CONFIGS[family]
    return getattr(transformers, name)(**{**kw, **changes})


def hf_model(family: str, seed: int = 0, **changes):
    """A random model; every parameter moved off its init, norm gains and biases (1-D) far off
    (by about 0.3: around 1 and 0 alike), so a mapping that mixes up two tensors, or a gain or bias
    handled wrongly across ranks, cannot go unnoticed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    return model.eval()


def save_hf(family: str, directory: str, seed: int = 0, dtype=None, **changes):
    from transformers.utils import logging

    logging.disable_progress_bar()  # it writes to stderr, which the CLI tests read
    model = hf_model(family, seed, **changes)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory)
    return model


def batch(b: int = 2, s: int = 32, vocab: int = 256, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@torch.no_grad()
def hf_logits(model) -> torch.Tensor:
    tokens, _ = batch()
    return model(input_ids=tokens).logits.float()


def hf_loss(logits: torch.Tensor) -> torch.Tensor:
    _, labels = batch()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             reduction="none").reshape(labels.shape)


@torch.no_grad()
def specc_logits(model, pg) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [b, s, vocab], per-token loss [b, s]) of a compiled model: the output layer's
    vocab-sharded [s, b, vocab/t] output captured by a hook and gathered over TP."""
    captured = []
    handle = model.output_layer.register_forward_hook(lambda m, i, out: captured.append(out.detach()))
    tokens, labels = batch()
    model.eval()
    loss = model(tokens, labels)
    handle.remove()
    local = captured[0].float().contiguous()
    if pg.tp.size > 1:
        pieces = [torch.empty_like(local) for _ in range(pg.tp.size)]
        dist.all_gather(pieces, local, group=pg.tp.group)
        local = torch.cat(pieces, dim=-1)
    return local.transpose(0, 1).contiguous(), loss.float()


def load_and_run(rank, world, family: str, ckpt: str, sp: bool = True):
    """On `world` ranks (or in this process when world == 1): the spec at TP=world, loaded from
    `ckpt`; returns (logits, per-token loss)."""
    from runtime.checkpoint import load_checkpoint

    pg = ProcessGroups.initialize(tp=world) if world > 1 else ProcessGroups.single()
    try:
        model = specc_torch.build_model(SPECS[family], pg, seed=123, sp=sp and world > 1)
        out = load_checkpoint(ckpt, model, pg)
        assert out["resharded"] == (world > 1)
        return specc_logits(model, pg)
    finally:
        pg.destroy()


def save_specc(rank, world, family: str, directory: str):
    """A compiled model at TP=world with random weights (not an init), saved; returns its logits."""
    from runtime.checkpoint import save_checkpoint

    pg = ProcessGroups.initialize(tp=world) if world > 1 else ProcessGroups.single()
    try:
        model = specc_torch.build_model(SPECS[family], pg, seed=321, sp=world > 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                meta = p._specc_init
                g = torch.Generator().manual_seed(len(name) * 7919 + sum(map(ord, name)))
                full = torch.randn(meta.full_shape, generator=g) * 0.05 + (1.0 if meta.kind == "ones" else 0.0)
                p.copy_(runtime.init.local_slice(full, meta))
        save_checkpoint(directory, 9, model, pg)
        return specc_logits(model, pg)
    finally:
        pg.destroy()


def sliced_parity_on_ranks(rank, world, tp, full, sources, expected, expected_loss, logits_of=specc_logits):
    """{(tp, sp): (largest logit difference, largest loss difference)} of each compiled source
    {(tp, sp): (model.py text, name)} at this TP size, with and without SP, against `expected`:
    the imported tensors `full` (read once in the parent) sliced into each setting's model, what
    load_checkpoint does at any TP (tested in runtime/checkpoint's tests), without reading the
    checkpoint once per setting on a busy machine. `logits_of(model, pg)` runs the test's batch."""
    from runtime.init import local_slice
    from specc_torch.api import load_module_from_source

    out = {}
    pg = ProcessGroups.initialize(tp=tp)
    try:
        for sp in (False, True) if tp > 1 else (False,):
            text, name = sources[tp, sp]
            model = load_module_from_source(text, name).build_model(pg, seed=123)
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    p.copy_(local_slice(full[pname], p._specc_init))
            logits, loss = logits_of(model, pg)
            out[tp, sp] = ((logits - expected).abs().max().item(), (loss - expected_loss).abs().max().item())
    finally:
        pg.destroy()
    return out
