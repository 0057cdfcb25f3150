import os
import sys

# hf_helpers beside these tests, importable by name here and in spawned gloo ranks.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
