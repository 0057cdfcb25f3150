"""The tokenizers by Megatron's --tokenizer-type, each through its library, against an independent
reference where there is one: GPT-2's BPE (through `tokenizers`) gives tiktoken's ids on the same
ranks; TikTokenizer reads the tiktoken file and Megatron's JSON alike and puts the special tokens
first; SentencePiece gets Megatron's special tokens; the vocabulary pads as Megatron's."""

from __future__ import annotations

import base64
import json

import pytest
from tokenizer_files import GPT2_PATTERN, GPT2_VOCAB_SIZE, gpt2_files, ranks, sentencepiece_model, tiktoken_files

from runtime.data import DataError, build_tokenizer, vocab_size_with_padding

TEXT = "the cat in the hen, 42 other\nthings  héllo <|endoftext|> theater\t\tend"


def test_gpt2_bpe_matches_tiktoken_on_the_same_ranks(tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    vocab, merges = gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    reference = tiktoken.Encoding("ref", pat_str=GPT2_PATTERN, mergeable_ranks=ranks(), special_tokens={})
    assert tok.encode(TEXT) == reference.encode_ordinary(TEXT)
    assert 258 in tok.encode(TEXT) and tok.decode(tok.encode(TEXT)) == TEXT  # " the" merged; round trip
    assert (tok.vocab_size, tok.eod) == (GPT2_VOCAB_SIZE, GPT2_VOCAB_SIZE - 1)  # "<|endoftext|>" in text: plain
    with pytest.raises(DataError, match="--merge-file is needed"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    (tmp_path / "bad.json").write_text(json.dumps({"a": 0}))
    with pytest.raises(DataError, match="no <\\|endoftext\\|> entry"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "bad.json"), merge_file=merges)


def test_huggingface_tokenizer_json_or_folder_with_its_eos(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "</s>": 3}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "m").mkdir()
    hf.save(str(tmp_path / "m" / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "m" / "tokenizer.json"))
    assert tok.encode("a b c a") == [1, 2, 0, 1] and tok.vocab_size == 4 and tok.eod is None
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "m")).eod == 3
    with pytest.raises(DataError, match="no such file"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "none"))


def test_sentencepiece_with_megatrons_special_tokens(tmp_path):
    pytest.importorskip("sentencepiece")
    import sentencepiece as spm

    model = sentencepiece_model(tmp_path)
    sp = spm.SentencePieceProcessor(model_file=model)
    n = len(sp)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    # <CLS> <SEP> <EOD> <MASK> and <PAD> (the model has no pad) are new ids; <s> </s> are its own
    assert (tok.vocab_size, tok.eod) == (n + 5, n + 2)
    assert tok.encode("the cat<EOD>a hen") == sp.encode_as_ids("the cat") + [n + 2] + sp.encode_as_ids("a hen")
    assert tok.decode(tok.encode("the cat<EOD>a hen")) == "the cat<EOD>a hen"
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert (gpt.vocab_size, gpt.eod, gpt.encode("the cat")) == (n, sp.eos_id(), sp.encode_as_ids("the cat"))
    llama2 = build_tokenizer("Llama2Tokenizer", tokenizer_model=model)  # Megatron's: the pieces, bos first
    assert sp.bos_id() >= 0 and llama2.name == "Llama2Tokenizer"
    assert (llama2.vocab_size, llama2.eod) == (n, sp.eos_id())
    assert llama2.encode("the cat") == [sp.bos_id()] + sp.encode_as_ids("the cat")
    (tmp_path / "not.model").write_bytes(b"garbage")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "not.model"))


def test_tiktokenizer_reads_tiktoken_and_megatron_rank_files_alike(tmp_path):
    pytest.importorskip("tiktoken")
    plain, megatron = tiktoken_files(tmp_path)
    n = len(ranks())
    toks = [build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken_pattern="v2", vocab_size=n + 4,
                            tiktoken_num_special_tokens=4) for path in (plain, megatron)]
    assert toks[0].encode(TEXT) == toks[1].encode(TEXT)
    assert toks[0].encode("the") == [4 + 257] and toks[0].eod == 2  # ranks after the specials; EOD </s>
    assert toks[0].decode(toks[0].encode(TEXT)) == TEXT and toks[0].vocab_size == n + 4
    with pytest.raises(DataError, match=f"{n} ranks, but --vocab-size 131072 with 1000 special tokens needs 130072"):
        build_tokenizer("TikTokenizer", tokenizer_model=plain, tiktoken_pattern="v1")
    (tmp_path / "bad.tiktoken").write_text("!!! x\n")
    with pytest.raises(DataError, match="not a tiktoken rank file"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(tmp_path / "bad.tiktoken"), tiktoken_pattern="v2")


def test_vocabulary_padding_and_the_null_tokenizer():
    assert vocab_size_with_padding(50257, 128, 1) == 50304  # GPT-2
    assert vocab_size_with_padding(50257, 128, 8) == 51200
    assert vocab_size_with_padding(256, 128, 2) == 256 and vocab_size_with_padding(257, 128, 2) == 512
    null = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert (null.vocab_size, null.eod, null.encode("5 6 999")) == (1001, 1000, [5, 6, 999])
    with pytest.raises(DataError, match="unknown"):
        build_tokenizer("Bert")


def test_tiktokenizer_vocabularies_too_small_for_its_special_tokens_or_its_bytes(tmp_path):
    # --vocab-size at or below the special tokens; or above them but cutting off single-byte ranks,
    # on which tiktoken panics (pyo3's PanicException, a BaseException) at the first encode
    pytest.importorskip("tiktoken")
    plain, _ = tiktoken_files(tmp_path)

    def tik(vocab_size, specials=1000):
        tok = build_tokenizer("TikTokenizer", tokenizer_model=plain, tiktoken_pattern="v2", vocab_size=vocab_size,
                              tiktoken_num_special_tokens=specials)
        return tok.encode("hello \xff")

    for vocab_size, byte in ((1001, "0x01 (rank 1)"), (1255, "0xff (rank 255)")):
        with pytest.raises(DataError) as e:
            tik(vocab_size)
        assert str(e.value) == (f"--vocab-size {vocab_size}: with 1000 special tokens it keeps ranks 0..{vocab_size - 1001} "
                                f"of {plain}, which leave out the single byte {byte}; byte-level BPE needs every byte: "
                                "give --vocab-size at least 1256")
    with pytest.raises(DataError) as e:
        tik(500)
    assert str(e.value) == ("--vocab-size 500: TikTokenizer's 1000 special tokens (--tiktoken-num-special-tokens) "
                            "take ids 0..999, so the vocabulary must be larger than 1000, with room for the ranks of "
                            "every single byte after them")
    with pytest.raises(DataError, match=r"^--tiktoken-num-special-tokens 2: must be at least 3 \(<unk>, <s>, </s>\)$"):
        tik(1256, specials=2)
    assert tik(1256) == [1000 + b for b in "hello \xff".encode()]  # the bytes alone: no merge kept
    tokens = [bytes([b]) for b in range(255)] + [b"ab"]  # 0xff has no rank
    (tmp_path / "no-ff.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                                     for r, t in enumerate(tokens)))
    with pytest.raises(DataError, match=r"no rank for the single byte 0xff \(1 of the 256 bytes have none\)"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(tmp_path / "no-ff.tiktoken"), tiktoken_pattern="v2",
                        vocab_size=1255, tiktoken_num_special_tokens=1000)


def test_null_tokenizer_names_what_is_not_an_id():
    null = build_tokenizer("NullTokenizer", vocab_size=1000)
    with pytest.raises(DataError) as e:
        null.encode("5 " + "9" * 100_000)  # more digits than Python converts
    assert str(e.value) == "NullTokenizer: token id 99999999999999999999... (100000 digits) is far too large for any " \
                           "vocabulary"
    with pytest.raises(DataError, match=r"^NullTokenizer reads space-separated token ids; the text holds 'x7'$"):
        null.encode("5 x7 6")
