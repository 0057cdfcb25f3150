"""`torchrun --nproc-per-node N -m specc_cli.rank SPEC [flags]`: one training rank launched by
hand, reading Megatron's flags itself (`specc train` checks everything first and starts its ranks
with the checked configuration instead: specc_torch.train.rank_main)."""

from __future__ import annotations

import os
import sys

from specc.errors import SpecError
from specc_torch.train import run  # imports torch: this module is a rank's entry only

from .main import build_parser
from .train_args import build_rank_parser
from .train_config import config_from_args


def rank_main(argv=None) -> int:
    """`torchrun --nproc-per-node N -m specc_cli.rank SPEC [flags]`: one rank (torchrun sets the env)
    parses Megatron's flags itself, then trains as `specc train`'s ranks do."""
    parser = build_rank_parser()
    parser.shares_flags_with = (build_parser(),)  # a spec maps no flag of specc's commands, here too
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except SpecError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(e.format(), file=sys.stderr)
        return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(rank_main())
