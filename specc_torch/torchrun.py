"""`python -m specc_torch.torchrun [torchrun's flags] -m specc_torch.train ...`: what `specc train`
launches its ranks with. It is torchrun (torch.distributed.run, the same flags and the same elastic
agent), except for how a failed run ends:

- A rank that stops on a user error (a checkpoint that does not load, a save directory of another
  run, a full disk: one line, exit code 2) writes its line into the folder that SPECC_ERROR_DIR
  names, instead of printing it. When the job fails, the first rank's line is printed once and
  the exit code is 2, as when one process trains: no ChildFailedError traceback, and none of the
  agent's log lines about the workers that stopped.
- Any other failure (a rank that crashed with its traceback, one killed by a signal) keeps the
  agent's log and ends with one line naming the first rank that failed, exit code 1.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

ERROR_DIR = "SPECC_ERROR_DIR"


def report_error(lines: list, rank: int) -> bool:
    """A rank's one-line error, handed to the launcher (True), when there is one to hand it to."""
    folder = os.environ.get(ERROR_DIR)
    if not folder or not os.path.isdir(folder):
        return False
    path = os.path.join(folder, f"rank_{rank:06d}")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(path + ".tmp", path)  # whole, or not there
    return True


def reported(folder: str) -> str | None:
    """The lines of the lowest rank that reported an error into `folder`, or None."""
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("rank_") and not n.endswith(".tmp"))
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        if text.strip():
            return text
    return None


class _QuietAfterReport(logging.Filter):
    """Drops torch.distributed's log records once a rank has reported its error: the agent's
    'failed (exitcode: 2)' and 'closing signal SIGTERM' lines say nothing the error does not."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("torch.distributed"):
            return True
        return reported(self.folder) is None


def _handlers(name: str) -> list:
    """The handlers a record of logger `name` reaches."""
    out, logger = [], logging.getLogger(name)
    while logger is not None:
        out += logger.handlers
        if not logger.propagate:
            break
        logger = logger.parent
    return out


def _failure_line(e) -> str:
    rank, failure = e.get_first_failure()
    how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    return f"error: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}; its output is above"


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    folder = tempfile.mkdtemp(prefix="specc-errors-")
    os.environ[ERROR_DIR] = folder  # the workers inherit the agent's environment
    quiet = _QuietAfterReport(folder)
    handlers = set(_handlers("torch.distributed.elastic.agent.server.api")
                   + _handlers("torch.distributed.elastic.multiprocessing.api") + _handlers("torch.distributed.run"))
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        run(args)
        return 0
    except ChildFailedError as e:
        text = reported(folder)
        if text is not None:
            sys.stderr.write(text)
            return 2
        print(_failure_line(e), file=sys.stderr)
        return 1
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
