"""`specc train` and its --save directory: one run at a time (a second run is one line naming the
first, before it trains; rank 0 decides for every rank), never over another run's checkpoints (a
fresh run is refused, --load DIR resumes them), and `--save X --load X` on an empty X starts
afresh."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
from train_cli import GPT_TINY, ROOT, SMALL, one_error_line, small_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("save_dir"))


def _contents(directory) -> dict:
    return {name: sorted(os.listdir(os.path.join(directory, name))) if os.path.isdir(os.path.join(directory, name))
            else open(os.path.join(directory, name), "rb").read() for name in os.listdir(directory)
            if name != "run.lock"}


def test_a_second_run_is_refused_and_a_killed_run_is_resumed_never_overwritten(specc, corpus, tmp_path):
    from runtime.checkpoint import latest_step

    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "specc_cli", "train", GPT_TINY, "--train-iters", "100000", "--save",
                              str(ckpt), "--save-interval", "1", "--data-path", corpus, "--run-dir",
                              str(tmp_path / "first"), *SMALL], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while latest_step(str(ckpt)) is None:
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first run saved nothing in 300 s"
            time.sleep(0.5)
        # while it trains: a second run into its directory, fresh or resuming, stops before training
        for resume in ((), ("--load", ckpt)):
            code, out, err = specc("train", GPT_TINY, "--train-iters", "2", "--save", ckpt, *resume, "--data-path",
                                   corpus, "--run-dir", tmp_path / "second", *SMALL)
            assert code == 2, out + err
            line = one_error_line(err)
            assert line.startswith(f"error: --save {ckpt}: {ckpt}: in use by another run (pid {first.pid} on "
                                   f"{socket.gethostname()}, since "), line
            assert line.endswith(f"which holds {ckpt}/run.lock); a save directory belongs to one run at a time: "
                                 f"wait for it to end, or save into another directory")
            assert not (tmp_path / "second").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)

    # killed: no stale lock, but its checkpoints are not a new run's to overwrite
    before = _contents(ckpt)
    step = latest_step(str(ckpt))
    shutil.copytree(ckpt, tmp_path / "elsewhere")  # a checkpoint to --load from another directory
    for load in ((), ("--load", tmp_path / "elsewhere")):
        code, out, err = specc("train", GPT_TINY, "--train-iters", "2", "--save", ckpt, *load, "--data-path", corpus,
                               "--run-dir", tmp_path / "fresh", *SMALL)
        assert code == 2, out + err
        loads = f" (it loads {tmp_path / 'elsewhere'})" if load else ""
        assert one_error_line(err) == (f"error: --save {ckpt} holds checkpoints (latest step {step}) that this run did "
                                        f"not write: a new run{loads} never overwrites them; resume them with --load "
                                        f"{ckpt}, or give another --save directory")
    assert _contents(ckpt) == before

    # --load of the directory resumes them (Megatron's --save X --load X)
    code, out, err = specc("train", GPT_TINY, "--train-iters", str(step + 1), "--save", ckpt, "--load", ckpt,
                           "--data-path", corpus, "--run-dir", tmp_path / "resumed", *SMALL)
    assert code == 0, out + err
    assert f"loaded checkpoint {ckpt / f'step_{step:07d}'} at iteration {step}" in out
    assert latest_step(str(ckpt)) == step + 1


def test_save_and_load_of_one_empty_directory_starts_fresh_then_resumes(specc, corpus, tmp_path):
    from runtime.checkpoint import latest_step

    ckpt = tmp_path / "ckpt"
    for iters in (1, 2):
        code, out, err = specc("train", GPT_TINY, "--train-iters", str(iters), "--save", ckpt, "--load", ckpt,
                               "--data-path", corpus, "--run-dir", tmp_path / "run", *SMALL)
        assert code == 0, out + err
        if iters == 1:
            assert (f"--load {ckpt}: no checkpoint there yet (it is the --save directory too): training starts from "
                    f"scratch") in out
        else:
            assert f"loaded checkpoint {ckpt / 'step_0000001'} at iteration 1" in out
        assert latest_step(str(ckpt)) == iters


# -- several ranks ---------------------------------------------------------------------------------

def _claim(rank, world, save, restart, run_id):
    from specc_torch.train_checks import claim_save_dir

    old = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:
        os.environ["TORCHELASTIC_RUN_ID"] = run_id
    try:
        cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(save=save, load=None))
        lock, error, own = claim_save_dir(cfg, rank, world, restart)
        held = lock is not None
        if lock is not None:
            lock.release()
        return held, error, own
    finally:
        if run_id is not None:
            if old is None:
                del os.environ["TORCHELASTIC_RUN_ID"]
            else:
                os.environ["TORCHELASTIC_RUN_ID"] = old


def test_rank_0_takes_the_lock_and_every_rank_learns_its_decision(gloo, tmp_path):
    import json

    from runtime.checkpoint import lock_save_dir

    save = str(tmp_path / "ckpt")
    with lock_save_dir(save) as lock:  # another run holds it
        lock.claim()
        results = gloo.run(2, _claim, save, 0, None)
    assert results[0] == results[1]
    held, error, own = results[0]
    assert not held and not own and error.startswith(f"--save {save}: {save}: in use by another run "
                                                     f"(pid {os.getpid()} on ")

    assert gloo.run(2, _claim, save, 0, None) == [(True, None, False), (False, None, False)]  # free, empty

    with open(os.path.join(save, "latest"), "w") as f:  # another run's checkpoints
        f.write("3\n")
    refused = (False, f"--save {save} holds checkpoints (latest step 3) that this run did not write: a new run never "
                      f"overwrites them; resume them with --load {save}, or give another --save directory", False)
    assert gloo.run(2, _claim, save, 0, None) == [refused, refused]
    # an elastic restart resumes them only when an earlier attempt of the same run claimed the directory
    with open(os.path.join(save, "run.lock"), "w") as f:
        json.dump({"pid": 1, "host": "h", "run": "job-a", "agent": "h:1"}, f)
    assert gloo.run(2, _claim, save, 1, "job-b") == [refused, refused]
    assert gloo.run(2, _claim, save, 1, "job-a") == [(True, None, True), (False, None, True)]
