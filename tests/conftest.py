"""Fixtures every test folder shares."""

import pytest


@pytest.fixture
def specc(capfd):
    """specc(*argv) -> (exit code, stdout, stderr), in this process, as `specc` runs it: the
    parser from specc.cli with the command modules of specc/commands registered."""
    from specc import cli
    from specc.commands import register_all

    def run(*argv):
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
        if "train" not in sub.choices:  # until specc/cli.py calls the command-module hook itself
            register_all(sub)
        build, cli.build_parser = cli.build_parser, lambda: parser
        try:
            code = cli.main([str(a) for a in argv])
        finally:
            cli.build_parser = build
        out, err = capfd.readouterr()
        return code, out, err

    return run
