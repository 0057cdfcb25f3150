"""`torchrun --nproc-per-node N -m runtime.train SPEC [flags]`: one rank of a training run."""

import sys

from .main import rank_main

if __name__ == "__main__":
    sys.exit(rank_main())
