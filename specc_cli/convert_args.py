"""What the checkpoint converters (`specc hf`, `specc megatron`) share: the spec, output and
`--set` flags, the specc checkpoint an export reads, and their errors as one located line."""

from __future__ import annotations

import argparse

from specc.errors import Loc, SpecError

from .args import overrides_from


def add_spec_and_out(c: argparse.ArgumentParser, spec_help: str, set_help: str) -> None:
    c.add_argument("--spec", required=True, metavar="SPEC", help=spec_help)
    c.add_argument("--out", required=True, metavar="DIR", help="output directory (must be new or empty)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def add_export_source(c: argparse.ArgumentParser) -> None:
    """An export's input: a specc save directory or step directory, from the same spec text."""
    c.add_argument("ckpt", metavar="CKPT", help="a save directory (its latest step) or one step_N directory")
    c.add_argument("--step", type=int, default=None, metavar="N", help="export step N instead of the latest")
    c.add_argument("--allow-spec-change", action="store_true",
                   help="export a checkpoint saved from another spec text if names and shapes match")


def overrides_of(args) -> dict:
    return {key: value for key, value, _ in overrides_from(args)}


def user_error(e: Exception) -> SpecError:
    """A converter's or the checkpoint's error, 'WHERE: WHAT': one located line."""
    where, sep, what = str(e).partition(": ")
    return SpecError(Loc(where), what) if sep else SpecError(None, str(e))
