import os
import sys

# The helpers module beside these tests, importable by name here and in spawned gloo ranks.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
