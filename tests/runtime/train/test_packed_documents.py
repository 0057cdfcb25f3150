"""Megatron's --reset-position-ids and --reset-attention-mask: packed documents, each restarting
after an end-of-document token. The data's position and document ids against Megatron's
get_ltor_masks_and_position_ids (its loop, transcribed); the model against an independent
reference: each document run on its own through the model compiled without the flags, at the
start of a sequence (causal attention never sees what follows it), must give the packed
sample's per-token losses of that document. Then TP 2 with SP, CP 2 (ring and all-gather) and
PP 2 give the packed losses of TP 1."""

import os

import pytest
import torch

from runtime.init import randomize_parameters
from runtime.parallel_state import ProcessGroups
from runtime.train import TrainConfig
from runtime.train.training import micro_batch, packed_documents
from specc_torch.api import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SPECS = {name: os.path.join(ROOT, "specs", f"{name}-tiny.yaml") for name in ("gpt", "llama")}
EOD, VOCAB, SEQ, SEED = 7, 256, 32, 11
RESET = dict(reset_position_ids=True, reset_attention_mask=True)
# documents per sample (lengths, each ending in the end-of-document token but a sample's last,
# cut mid-document): a one-token document (an EOD at the start) and unequal lengths
DOCS = [[1, 9, 14, 8], [12, 3, 17]]


def _sample_batch() -> tuple:
    """tokens, labels [2, SEQ]: random non-EOD tokens with the EOD closing each document."""
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(8, VOCAB, (2, SEQ), generator=g)
    for row, lengths in enumerate(DOCS):
        assert sum(lengths) == SEQ
        for end in torch.tensor(lengths).cumsum(0)[:-1].tolist():
            tokens[row, end - 1] = EOD
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return tokens, labels


def _megatron_ltor(data: torch.Tensor, eod: int) -> tuple:
    """megatron/core/datasets/gpt_dataset.py's _get_ltor_masks_and_position_ids with both reset
    flags, its loop as Megatron writes it: (attention allowed [s, s] bool, position ids [s])."""
    seq_length = data.numel()
    attention_mask = torch.tril(torch.ones((seq_length, seq_length)))
    position_ids = torch.arange(seq_length, dtype=torch.long)
    eod_index = position_ids[data == eod].clone()
    prev_index = 0
    for j in range(eod_index.numel()):
        i = eod_index[j]
        attention_mask[(i + 1):, :(i + 1)] = 0
        position_ids[(i + 1):] -= i + 1 - prev_index
        prev_index = i + 1
    return attention_mask > 0.5, position_ids


def test_position_and_document_ids_are_megatrons():
    tokens, _ = _sample_batch()
    tokens[1, -1] = EOD  # an EOD as the last token too
    positions, documents = packed_documents(tokens, EOD)
    for row in range(tokens.shape[0]):
        allowed, want = _megatron_ltor(tokens[row], EOD)
        assert torch.equal(positions[row], want)
        same = documents[row][:, None] == documents[row][None, :]
        assert torch.equal(same & torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), allowed)


def test_the_micro_batch_carries_the_models_inputs_in_the_specs_order():
    class Data:
        def micro_batch(self, consumed, micro, mbs, dp_rank, dp_size):
            tokens, labels = _sample_batch()
            return tokens.numpy(), labels.numpy()

    cfg = TrainConfig(spec=SPECS["gpt"], micro_batch_size=2, global_batch_size=2)
    cfg.data.eod, cfg.data.eod_mask_loss, cfg.data.reset_attention_mask = EOD, True, True
    tokens, documents, labels, mask = micro_batch(Data(), 0, 0, cfg, ProcessGroups.single(), torch.device("cpu"))
    assert torch.equal(documents, packed_documents(tokens, EOD)[1]) and torch.equal(mask, (tokens != EOD).float())
    cfg.data.reset_position_ids, cfg.data.eod_mask_loss = True, False
    tokens, positions, documents, labels = micro_batch(Data(), 0, 0, cfg, ProcessGroups.single(), torch.device("cpu"))
    assert torch.equal(positions, packed_documents(tokens, EOD)[0])


@torch.no_grad()
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_packed_sample_gives_each_documents_own_losses(name):
    """gpt: learned absolute positions; llama: rotary, grouped-query attention."""
    tokens, labels = _sample_batch()
    packed = build_model(SPECS[name], micro_batch_size=2, **RESET)
    alone = build_model(SPECS[name], micro_batch_size=1)
    randomize_parameters(packed, SEED)
    randomize_parameters(alone, SEED)
    got = packed(tokens, *packed_documents(tokens, EOD), labels)
    filler = torch.full((1, SEQ), 3)
    for row, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:  # the document at the start of its own sequence, positions 0..n-1
            doc_tokens, doc_labels = filler.clone(), filler.clone()
            doc_tokens[0, :n], doc_labels[0, :n] = tokens[row, start:start + n], labels[row, start:start + n]
            want = alone(doc_tokens, doc_labels)[0, :n]
            # fp32, the same products summed over other mask shapes (SDPA's causal kernel against an
            # explicit mask): a few ulps of the loss (about 5.5 = ln 256)
            torch.testing.assert_close(got[row, start:start + n], want, rtol=1e-5, atol=1e-5)
            start += n
    # the same weights without the flags: the later documents see the earlier ones (what the
    # check above tells apart)
    unpacked = build_model(SPECS[name], micro_batch_size=2)
    randomize_parameters(unpacked, SEED)
    assert not torch.allclose(unpacked(tokens, labels), got, rtol=1e-3)


LAYOUTS = [  # (spec, settings at 2 ranks): rotary (llama) on every axis, learned positions (gpt, replicated
    # under TP) on CP's load-balanced chunks
    ("llama", dict(tp=2, sp=True)), ("llama", dict(cp=2, cp_comm_type="all_gather")), ("llama", dict(pp=2)),
    ("gpt", dict(cp=2, cp_comm_type="p2p")),
]


@torch.no_grad()
def _packed_losses_at(rank, world):
    """Each LAYOUTS entry's per-token losses of the packed batch (rank 0's; the whole batch)."""
    from runtime.pipeline import Pipeline

    tokens, labels = _sample_batch()
    inputs = (tokens, *packed_documents(tokens, EOD), labels)
    out = []
    for name, settings in LAYOUTS:
        pp = settings.get("pp", 1)
        pg = ProcessGroups.initialize(tp=settings.get("tp", 1), cp=settings.get("cp", 1), pp=pp)
        try:
            model = build_model(SPECS[name], pg, micro_batch_size=1 if pp > 1 else 2, **RESET,
                                **{k: v for k, v in settings.items() if k not in ("tp", "cp")})
            randomize_parameters(model, SEED)
            if pp > 1:  # one sample a micro-batch, the inputs by name to every stage
                names = ("tokens", "position_ids", "document_ids", "labels")
                micro = [tuple(t[i:i + 1] for t in inputs) for i in range(2)]
                loss = Pipeline(model, pg, 2, names).outputs(micro)
                loss = loss if loss is not None else torch.zeros_like(tokens, dtype=torch.float32)
                torch.distributed.all_reduce(loss)  # the last stage's, to every rank
            else:
                loss = model(*inputs)
            out.append(loss.clone())
        finally:
            pg.destroy()
    return out


def test_packed_losses_are_the_same_at_tp_sp_cp_and_pp(gloo):
    got = gloo.run(2, _packed_losses_at)[0]
    tokens, labels = _sample_batch()
    for (name, settings), loss in zip(LAYOUTS, got):
        model = build_model(SPECS[name], micro_batch_size=2, **RESET)
        randomize_parameters(model, SEED)
        want = model(tokens, *packed_documents(tokens, EOD), labels).detach()
        # fp32 sums split over ranks and blocks (CP's online softmax): a few ulps of the loss
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {settings}: {m}")


def test_attention_kernels_without_a_document_mask_fall_back_and_a_spec_with_no_reader_is_refused():
    from specc.compiler import load_and_compile
    from specc.errors import SpecError
    from specc.settings import Settings

    # where TransformerEngine is installed `auto` picks it; with document ids attention runs native
    _, graph = load_and_compile(SPECS["llama"], Settings(reset_attention_mask=True), have=lambda backend: True,
                                plan_only=True)
    attention = [op for op in graph.iter_ops() if op.kind == "core_attention"]
    assert attention and all(op.impl == "native" and "document ids" in op.impl_reason for op in attention)
    with pytest.raises(SpecError, match="no rotary or position_embedding op to take position_ids"):
        load_and_compile(os.path.join(ROOT, "specs", "bloom-tiny.yaml"), Settings(reset_position_ids=True))


def test_a_training_step_reports_the_masked_loss_of_the_packed_documents():
    """The loop's path: micro_batch gives (tokens, position_ids, document_ids, labels, loss mask)
    and train_step reports Megatron's loss, the masked per-token losses over their count."""
    from runtime.train.training import setup_model_and_optimizer, train_step
    from specc_torch.train_compile import compile_model

    class Data:
        def micro_batch(self, consumed, micro, mbs, dp_rank, dp_size):
            tokens, labels = _sample_batch()
            return tokens.numpy(), labels.numpy()

    cfg = TrainConfig(spec=SPECS["llama"], micro_batch_size=2, global_batch_size=2)
    cfg.data.eod, cfg.data.eod_mask_loss, cfg.data.reset_position_ids, cfg.data.reset_attention_mask = EOD, True, True, True
    setup = setup_model_and_optimizer(cfg, ProcessGroups.single(), compiled=compile_model(cfg))
    batch = micro_batch(Data(), 0, 0, cfg, ProcessGroups.single(), torch.device("cpu"))
    with torch.no_grad():
        per_token = setup.model(*batch[:4])
    want = float((per_token * batch[4]).sum() / batch[4].sum())
    assert train_step(setup, [batch], 0.0, ProcessGroups.single()).loss == pytest.approx(want, rel=1e-6)


def test_train_refuses_packed_documents_it_cannot_reset_in_one_line(specc, tmp_path):
    code, out, err = specc("train", SPECS["gpt"], "--mock-data", "--reset-position-ids", "--reset-attention-mask",
                           "--run-dir", tmp_path)
    assert code != 0 and err.strip().count("\n") == 0, err
    assert "--reset-position-ids/--reset-attention-mask needs the end-of-document token's id" in err
    # Megatron resets the mask its data loader builds: without one the reset does not happen there
    code, out, err = specc("train", SPECS["gpt"], "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                           "200", "--reset-attention-mask", "--no-create-attention-mask-in-dataloader",
                           "--run-dir", tmp_path)
    assert code != 0 and "--reset-attention-mask with --no-create-attention-mask-in-dataloader" in err, err
