"""specc: a compiler from declarative model specs to tensor/sequence-parallel PyTorch modules.

The compiler imports no torch: compile, plan, diff, check and validate are pure text in, text out.
"""

__version__ = "0.1.0"
