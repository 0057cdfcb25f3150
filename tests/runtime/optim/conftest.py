import os
import sys

# The training helpers (tests/runtime/train), importable by name here and in spawned gloo ranks.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train"))
