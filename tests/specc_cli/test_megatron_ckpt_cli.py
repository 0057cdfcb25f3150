"""`specc megatron import` then `specc megatron export` from the command line, on the checkpoints
Megatron Core wrote (tests/fixtures/megatron): what each prints, and every user mistake is one
line with exit code 2 and nothing written. The numbers are tests/specc_torch/test_megatron_ckpt.py's."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "megatron", "llama")
SPEC = os.path.join(ROOT, "specs", "llama-tiny.yaml")
CONFIG = {"hidden_size": 16, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 24,
          "vocab_size": 128, "seq_length": 8}  # make_fixture.MODEL's, vocab_size Megatron's padded
SIZES = [arg for key, value in CONFIG.items() for arg in ("--set", f"{key}={value}")]


def test_import_export_and_one_line_errors(specc, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "megatron"
    legacy = os.path.join(FIXTURE, "torch")
    code, stdout, stderr = specc("megatron", "import", legacy, "--spec", SPEC, "--out", ckpt, *SIZES)
    assert (code, stderr) == (0, ""), stderr
    assert stdout == (f"specc megatron import: {legacy} (torch, 15 tensors, 8,016 parameters) -> "
                      f"{ckpt}/step_0000007 (spec llama_tiny, step 7)\n")
    code, stdout, stderr = specc("megatron", "export", ckpt, "--spec", SPEC, "--out", out, *SIZES)
    assert (code, stderr) == (0, ""), stderr
    assert stdout == (f"specc megatron export: {ckpt} (step 7, spec llama_tiny) -> {out}/iter_0000007 (torch_dist, "
                      "15 tensors, 8,016 parameters; weights only: the checkpoint has no optimizer state)\n")
    assert sorted(os.listdir(out)) == ["iter_0000007", "latest_checkpointed_iteration.txt"]

    def error(*argv) -> str:
        code, stdout, stderr = specc("megatron", *argv)
        assert code == 2 and stdout == "" and stderr.count("\n") == 1, (code, stdout, stderr)
        return stderr.strip()

    fresh = tmp_path / "fresh"
    # the tokenizer's vocabulary where Megatron saved the padded one
    assert error("import", FIXTURE + "/torch_dist", "--spec", SPEC, "--out", fresh, *SIZES[:-4],
                 "--set", "vocab_size=100", "--set", "seq_length=8").endswith("(Megatron pads the vocabulary to a multiple of "
                                                     "--make-vocab-size-divisible-by x TP: --set vocab_size=128)")
    assert error("import", tmp_path, "--spec", SPEC, "--out", fresh, *SIZES) == (
        f"{tmp_path}: error: not a Megatron checkpoint (no latest_checkpointed_iteration.txt, no iter_*/ with its "
        "files)")
    assert error("import", FIXTURE + "/torch_dist", "--spec", SPEC, "--out", fresh, *SIZES,
                 "--iteration", "9") == f"{FIXTURE}/torch_dist: error: no iter_0000009/ (iteration 9)"
    assert error("export", ckpt, "--spec", SPEC, "--out", out, *SIZES) == (
        f"{out}: error: already exists and is not empty (choose a new directory)")
    neox = os.path.join(ROOT, "specs", "gpt-neox-tiny.yaml")
    assert error("export", ckpt, "--spec", neox, "--out", fresh) == (
        f"{neox}: error: spec gpt_neox_tiny declares no Megatron checkpoint mapping ('megatron: checkpoint: "
        "params:') (see docs/checkpoints.md; specs/llama.yaml has one)")
    assert not fresh.exists()


def test_train_starts_from_a_megatron_checkpoint_with_finetune(specc, tmp_path):
    """`specc train --load MEGATRON_DIR --finetune` trains from its weights: with a learning rate
    too small to move an fp32 weight (1e-30 against ulps of 1e-8), the checkpoint the run saves
    holds Megatron's weights bit for bit. Without --finetune the legacy format is one line (weights only)."""
    import torch

    from runtime.checkpoint import read_tensors
    from specc_torch.megatron_ckpt import read_weights

    run = ["train", SPEC, *SIZES, "--mock-data", "--train-iters", "1", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--eval-iters", "0", "--log-interval", "1", "--no-progress", "--lr", "1e-30",
           "--load", os.path.join(FIXTURE, "torch"), "--save", tmp_path / "save", "--run-dir", tmp_path / "run"]
    code, stdout, stderr = specc(*run)
    assert code == 2 and stderr.strip().endswith(
        "from Megatron's legacy torch format only the weights are read (not its optimizer state, iteration or data "
        "position): add --finetune (or save it with --ckpt-format torch_dist)"), stderr
    code, stdout, stderr = specc(*run, "--finetune")
    assert code == 0, stderr
    assert f"loaded model weights from {tmp_path}/run/megatron-import/step_0000007 (--finetune)" in stdout + stderr
    saved = read_tensors(str(tmp_path / "save"))
    megatron = read_weights(os.path.join(FIXTURE, "torch"), SPEC, CONFIG)["tensors"]
    assert saved.keys() == megatron.keys() and all(torch.equal(saved[n], megatron[n]) for n in saved)


def test_a_malformed_checkpoint_block_is_a_located_error(specc, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(f"extends: {SPEC}\nmegatron:\n  checkpoint:\n    params:\n      - {{specc: embedding.weight}}\n"
                    "    ignores: []\n")
    code, stdout, stderr = specc("validate", spec)
    assert code == 2 and stderr == (f"{spec}:6:5: error: unknown key 'ignores' in 'megatron.checkpoint' "
                                    "(did you mean 'ignore'?)\n"), stderr
    spec.write_text(f"extends: {SPEC}\nmegatron:\n  checkpoint:\n    params:\n      - {{specc: embedding.weight}}\n")
    code, stdout, stderr = specc("validate", spec)
    assert code == 2 and stderr.startswith(f"{spec}:5:9: error: 'megatron' must be a parameter name"), stderr


def test_train_saves_megatrons_torch_dist_beside_its_own(specc, tmp_path):
    """`specc train --save S --ckpt-format torch_dist`: each save is specc's step_N/ (which a --load S
    resumes, optimizer state and all) and Megatron's iter_N/ with its tracker, holding the same
    weights bit for bit; --keep-last prunes both. Megatron's dist_checkpointing.load of such a
    directory gives specc's loss (make_fixture.py --check-train; Megatron is not a test dependency)."""
    import torch

    from runtime.checkpoint import read_tensors
    from specc_torch.megatron_ckpt import read_weights

    save = tmp_path / "save"
    run = ["train", SPEC, *SIZES, "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
           "--eval-iters", "0", "--no-progress", "--save", save, "--save-interval", "1", "--keep-last", "1",
           "--ckpt-format", "torch_dist", "--run-dir", tmp_path / "run"]
    code, stdout, stderr = specc(*run, "--train-iters", "2")
    assert code == 0, stderr
    assert f"saved Megatron's torch_dist checkpoint {save}/iter_0000002" in stdout + stderr
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest", "latest_checkpointed_iteration.txt", "run.lock",
                                        "step_0000002"]
    with open(save / "latest_checkpointed_iteration.txt") as f:
        assert f.read() == "2"
    ours, megatron = read_tensors(str(save)), read_weights(str(save), SPEC, CONFIG)
    assert megatron["iteration"] == 2 and megatron["format"] == "torch_dist"
    assert ours.keys() == megatron["tensors"].keys()
    assert all(torch.equal(ours[n], megatron["tensors"][n]) for n in ours)
    # --load of that directory resumes specc's own checkpoint (not a weights-only Megatron load)
    code, stdout, stderr = specc(*run, "--train-iters", "3", "--load", save)
    assert code == 0, stderr
    assert f"loaded checkpoint {save}/step_0000002 at iteration 2" in stdout + stderr
    assert sorted(os.listdir(save))[:2] == ["iter_0000003", "latest"]

    def error(*argv) -> str:
        code, stdout, stderr = specc("train", SPEC, *SIZES, "--mock-data", "--train-iters", "1", *argv)
        assert code == 2 and stderr.count("\n") == 1, (code, stderr)
        return stderr.strip()

    assert error("--ckpt-format", "torch", "--save", tmp_path / "other") == (
        "error: --ckpt-format torch: only torch_dist (Megatron Core's default) is written, beside specc's own "
        "checkpoints; --load reads Megatron's torch_dist and legacy torch checkpoints whatever this says")
    assert error("--ckpt-format", "torch_dist") == (
        "error: --ckpt-format torch_dist: says what --save writes, and there is no --save DIR")
    assert not (tmp_path / "other").exists()


def test_train_resumes_a_megatron_checkpoint_with_its_optimizer_state(specc, tmp_path):
    """`specc train --load MEGATRON_DIR` resumes as Megatron does: iteration 3, 6 samples consumed and
    Megatron's Adam state (llama_optim: Megatron trained 3 steps); --no-load-optim takes all but the
    optimizer state. The numbers (specc's next step equals Megatron's) are test_megatron_ckpt.py's."""
    from runtime.checkpoint import read_info

    load = os.path.join(ROOT, "tests", "fixtures", "megatron", "llama_optim", "torch_dist")
    sizes = [arg for key, value in {**CONFIG, "vocab_size": 64}.items() for arg in ("--set", f"{key}={value}")]
    run = ["train", SPEC, *sizes, "--mock-data", "--train-iters", "4", "--micro-batch-size", "2",
           "--global-batch-size", "2", "--eval-iters", "0", "--no-progress", "--lr", "0.01", "--load", load]
    code, stdout, stderr = specc(*run, "--save", tmp_path / "save", "--run-dir", tmp_path / "run")
    assert code == 0, stderr
    assert f"loaded checkpoint {tmp_path}/run/megatron-import/step_0000003 at iteration 3" in stdout + stderr
    info = read_info(str(tmp_path / "save" / "step_0000004"))
    assert info["step"] == 4 and "exp_avg/embedding.weight" in info["optimizer"]["sharded"]
    code, stdout, stderr = specc(*run, "--no-load-optim", "--run-dir", tmp_path / "run2")
    assert code == 0, stderr
    assert (f"loaded checkpoint {tmp_path}/run2/megatron-import/step_0000003 at iteration 3 without its optimizer "
            "state (--no-load-optim): a fresh optimizer") in stdout + stderr
    # the commands: import converts the optimizer state (and says so), export writes it back
    code, stdout, stderr = specc("megatron", "import", load, "--spec", SPEC, "--out", tmp_path / "ckpt", *sizes)
    assert (code, stderr) == (0, ""), stderr
    assert stdout == (f"specc megatron import: {load} (torch_dist, 15 tensors, 5,968 parameters) -> {tmp_path}/ckpt/"
                      "step_0000003 (spec llama_tiny, step 3; its optimizer state (exp_avg, exp_avg_sq, master) at step "
                      "3, 6 samples consumed)\n")
    code, stdout, stderr = specc("megatron", "export", tmp_path / "ckpt", "--spec", SPEC, "--out", tmp_path / "m", *sizes)
    assert (code, stderr) == (0, ""), stderr
    assert stdout.endswith("(torch_dist, 15 tensors, 5,968 parameters; Adam state at step 3 (exp_avg, exp_avg_sq))\n")
