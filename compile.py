"""`python compile.py SPEC [flags]` is `specc compile SPEC [flags]`, for people without the install."""

import sys

from specc_cli.main import main

if __name__ == "__main__":
    sys.exit(main(["compile", *sys.argv[1:]]))
