"""`specc train SPEC [flags]`: validate everything, then launch the ranks through torchrun.
`torchrun ... -m specc_cli.rank SPEC [flags]` (specc_cli/rank.py) is one rank for people who launch
ranks themselves.

Megatron's flag names, with Megatron's meaning, so Megatron's command lines work after
`specc train SPEC --nproc-per-node N`. The flags are specc_cli/train_args.py. Nothing here
imports torch at import time: specc_torch.train is imported when the command runs.
"""

from __future__ import annotations

from .train_args import add_train_arguments, build_rank_parser


def cmd_train(args) -> int:
    from specc_torch.train import launch  # imports torch: only now

    from .train_config import config_from_args, launch_from_args

    return launch(config_from_args(args), launch_from_args(args))


def add_parsers(sub) -> None:
    c = sub.add_parser("train", help="train a spec on torchrun ranks (Megatron's flags; imports torch)",
                       description="Train SPEC. Megatron's flags keep their meaning; --nproc-per-node N launches "
                       "N ranks through torchrun (its multi-node flags pass through).")
    add_train_arguments(c, launcher=True)
    c.shares_flags_with = (build_rank_parser(),)  # the ranks read its command line: a spec maps none of its flags
    c.set_defaults(func=cmd_train)
