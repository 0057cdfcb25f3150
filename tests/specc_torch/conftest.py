import os
import sys

# The `gloo` fixture (tests/runtime/multiproc.py's rank pools) is tests/conftest.py's, shared by
# every folder.

# verify_cli.run_verify: `specc verify` inside the test process, importable by name in the tests here
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
