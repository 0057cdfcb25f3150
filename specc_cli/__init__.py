"""specc's command line: the top layer, above the compiler (`specc/`, no torch) and what needs
both the compiler and torch (`specc_torch/`). Nothing below imports this package.

    specc_cli.main        `specc` (argparse, the compiler's commands: validate, compile, plan, graph,
                          diff, verify, check) and the entry point
    specc_cli.train       `specc train` and `torchrun -m specc_cli.train SPEC [flags]` (one rank)
    specc_cli.train_args  training's flags (Megatron's names and meaning)
    specc_cli.megatron_flags  a spec's `megatron:` block checked against the flags
    specc_cli.data, .plot, .hf  `specc data`, `specc plot`, `specc hf`

No module here imports torch at import time (the command line starts fast); a command imports
specc_torch or the runtime when it runs."""
