"""The shipped families' tiny Hugging Face configs (random weights, no download), each beside
its tiny spec, and the parity run: HF model -> `specc hf import` -> the compiled spec's logits at
TP 1, 2, 4 with and without SP, all in one 4-rank gloo world."""

from __future__ import annotations

import os
import types

import torch

import specc_torch
from runtime.parallel_state import ProcessGroups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SEQ, BATCH, VOCAB = 16, 2, 256


def _spec(name: str) -> str:
    return os.path.join(ROOT, "specs", f"{name}-tiny.yaml")


def _llama_like(**kw):
    base = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
                num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=32, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
    base.update(kw)
    return base


def hf_config(family: str):
    import transformers as T

    if family == "llama3":
        return T.LlamaConfig(**_llama_like(rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    if family == "qwen2":
        return T.Qwen2Config(**_llama_like(rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    if family == "mistral":
        return T.MistralConfig(**_llama_like(head_dim=8, sliding_window=5))
    if family == "phi3":
        return T.Phi3Config(**_llama_like(num_key_value_heads=4, pad_token_id=0, bos_token_id=0, eos_token_id=0))
    if family == "gpt-neox":
        return T.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
                               vocab_size=VOCAB, max_position_embeddings=32, layer_norm_eps=1e-5,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25},
                               hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    if family == "gemma2":  # a window of 4 in 16 tokens; caps and score scale that matter (specs/gemma2-tiny.yaml)
        return T.Gemma2Config(**_llama_like(head_dim=16, num_hidden_layers=3, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                            sliding_window=4, query_pre_attn_scalar=8, attn_logit_softcapping=1.0,
                                            final_logit_softcapping=2.0, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    if family == "bert":
        return T.BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
                            vocab_size=VOCAB, max_position_embeddings=32, type_vocab_size=2,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    raise KeyError(family)


FAMILIES = {name: _spec(name) for name in ("llama3", "qwen2", "mistral", "phi3", "gpt-neox", "bert", "gemma2")}


def hf_model(family: str, seed: int = 0):
    """A random model; every parameter moved off its init, norm gains and biases (1-D) far off
    (by about 0.3: around 1 and 0 alike; Gemma 2's stored gain - 1 too)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(seed)
    config = hf_config(family)
    auto = AutoModelForMaskedLM if config.model_type == "bert" else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    return model.eval()


def inputs(seed: int = 5) -> dict:
    """One batch; the second sequence is 11 tokens and 5 pads (attention_mask 1/0), for the
    models that take a padding mask."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, 11:] = 0
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "token_types": (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).contiguous(),
            "attention_mask": mask}


def real(batch: dict, family: str) -> torch.Tensor:
    """[b, s] True where a token is real: a pad's own output is whatever each side makes of it."""
    if family == "bert":
        return batch["attention_mask"].bool()
    return torch.ones_like(batch["tokens"], dtype=torch.bool)


@torch.no_grad()
def hf_logits(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output layer's logits, the per-token loss of the model's logits): they differ where
    the logits are soft-capped after the output layer (Gemma 2)."""
    head = model.get_output_embeddings()
    captured = []
    handle = head.register_forward_hook(lambda m, i, out: captured.append(out.detach().float()))
    if model.config.model_type == "bert":
        logits = model(input_ids=batch["tokens"], token_type_ids=batch["token_types"],
                       attention_mask=batch["attention_mask"]).logits.float()
    else:
        logits = model(input_ids=batch["tokens"]).logits.float()
    handle.remove()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                             reduction="none").reshape(batch["labels"].shape)
    return captured[0], loss


@torch.no_grad()
def specc_logits(model, batch: dict, names: list, tp) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output layer's vocab-sharded [s, b, vocab/t] logits, gathered over TP, as [b, s, vocab];
    the per-token loss the model returns)."""
    from runtime.mappings import gather_last

    captured = []
    handle = model.output_layer.register_forward_hook(lambda m, i, out: captured.append(out.detach()))
    model.eval()
    loss = model(*[batch[n] for n in names])
    handle.remove()
    logits = gather_last(captured[0].float().contiguous(), tp) if tp.size > 1 else captured[0].float()
    return logits.transpose(0, 1).contiguous(), loss.float()


class _Compiled(Exception):
    """parity's compile-only pass: the module is compiled, build_model stops there."""


def parity(rank: int, world: int, cases: list) -> list:
    """On `world` ranks: every (family, checkpoint, input names, batch) at each TP size dividing
    the world, with and without SP; [(family, tp, sp, logits, loss)] on rank 0 of each TP group.
    Each model is compiled once, on one rank, and handed to the others (compiling, 80% of this
    run, was done by every rank for every model)."""
    import torch.distributed as dist

    import specc_torch.api as api
    from runtime.checkpoint import load_checkpoint

    compile_source, compiled, only_compile = api.compile_source, {}, [False]

    def remembered(*args, **kwargs):  # by its arguments, whatever they are: build_model's call
        key = repr((args, sorted(kwargs.items())))
        if key not in compiled:
            text, spec, _ = compile_source(*args, **kwargs)
            compiled[key] = (text, types.SimpleNamespace(name=spec.name), None)  # what build_model reads
        if only_compile[0]:
            raise _Compiled  # no model built: its construction may talk to the other ranks of its group
        return compiled[key]

    api.compile_source = remembered
    out = []
    try:
        for tp in (1, 2, 4):
            if world % tp:
                continue
            pg = ProcessGroups.initialize(tp=tp)
            try:
                jobs = [(case, sp) for case in cases for sp in ((False, True) if tp > 1 else (False,))]
                only_compile[0] = True
                for (_, spec, _, _, _), sp in jobs[rank::world]:  # this rank's share, then everyone's
                    try:
                        specc_torch.build_model(spec, pg, seed=123, sp=sp)
                    except _Compiled:
                        pass
                only_compile[0] = False
                shares = [None] * world
                dist.all_gather_object(shares, compiled)
                for share in shares:
                    compiled.update(share)
                for (family, spec, ckpt, names, batch), sp in jobs:
                    model = specc_torch.build_model(spec, pg, seed=123, sp=sp)
                    load_checkpoint(ckpt, model, pg)
                    logits, loss = specc_logits(model, batch, names, pg.tp)
                    if rank == 0:
                        out.append((family, tp, sp, logits, loss))
            finally:
                pg.destroy()
    finally:
        api.compile_source = compile_source
    return out
