"""A process that saves a checkpoint and stops at a chosen point to be killed with SIGKILL:

    python ckpt_kill_worker.py DIR PHASE SEED STEP

PHASE: "write" (inside DCP's file write, after a few tensors: a half-written shard file), "info"
(half of checkpoint.json written, before the rename), "latest" (the directory renamed into place,
`latest` not yet replaced), or "none" (save completely). It prints "PAUSED PHASE" and waits."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed.checkpoint.filesystem as dcp_fs
from ckpt_helpers import GPT

import runtime.checkpoint.on_disk as on_disk
import specc_torch
from runtime.checkpoint import save_checkpoint

SIZE = {"hidden_size": 256, "num_layers": 4}  # about 3.2M parameters, 13 MB


def _pause(phase: str) -> None:
    print(f"PAUSED {phase}", flush=True)
    time.sleep(120)
    os._exit(3)  # not reached: the test kills us


def main() -> None:
    directory, phase, seed, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model = specc_torch.build_model(GPT, seed=seed, overrides=SIZE)
    if phase == "write":
        original, written = dcp_fs._write_item, [0]

        def write_item(transforms, stream, *args, **kwargs):
            result = original(transforms, stream, *args, **kwargs)
            written[0] += 1
            if written[0] == 4:
                stream.flush()
                _pause(phase)
            return result

        dcp_fs._write_item = write_item
    elif phase in ("info", "latest"):
        original_write = on_disk._write_durably

        def write_durably(path, text):
            if phase == "info" and os.path.basename(path) == on_disk.INFO:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text[: len(text) // 2])
                _pause(phase)
            if phase == "latest" and os.path.basename(path).startswith(on_disk.LATEST + ".tmp-"):
                _pause(phase)
            original_write(path, text)

        on_disk._write_durably = write_durably
    save_checkpoint(directory, step, model)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
