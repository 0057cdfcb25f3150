"""`specc hf import HF_DIR --spec SPEC --out CKPT` and `specc hf export CKPT --spec SPEC --out HF_DIR`:
Hugging Face safetensors <-> specc checkpoints, by the mapping the spec declares under `hf:`
(docs/checkpoints.md). The runtime (torch, safetensors) is imported when a command runs."""

from __future__ import annotations

import argparse

from specc.errors import Loc, SpecError


def add_parsers(sub) -> None:
    p = sub.add_parser("hf", help="import or export Hugging Face checkpoints (safetensors) by the spec's hf: mapping",
                       description="Convert between a Hugging Face model directory (config.json, model.safetensors) "
                       "and a specc checkpoint, by the mapping the spec declares under hf:.")
    hf_sub = p.add_subparsers(dest="hf_command", metavar="ACTION")
    hf_sub.required = True

    c = hf_sub.add_parser("import", help="HF_DIR -> a new specc checkpoint directory (step 0), loadable at any TP")
    c.add_argument("hf_dir", metavar="HF_DIR", help="a Hugging Face model directory")
    _common(c)
    c.set_defaults(func=cmd_import)

    c = hf_sub.add_parser("export", help="a specc checkpoint -> a new Hugging Face model directory")
    c.add_argument("ckpt", metavar="CKPT", help="a save directory (its latest step) or one step_N directory")
    _common(c)
    c.add_argument("--step", type=int, default=None, metavar="N", help="export step N instead of the latest")
    c.add_argument("--allow-spec-change", action="store_true",
                   help="export a checkpoint saved from another spec text if names and shapes match")
    c.set_defaults(func=cmd_export)


def _common(c: argparse.ArgumentParser) -> None:
    c.add_argument("--spec", required=True, metavar="SPEC", help="the spec whose hf: mapping to use")
    c.add_argument("--out", required=True, metavar="DIR", help="output directory (must be new or empty)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value of the spec; repeatable")


def _overrides(args) -> dict:
    from specc_cli.args import overrides_from

    return {key: value for key, value, _ in overrides_from(args)}


def _user_error(e: Exception) -> SpecError:
    """CheckpointError / HFError messages are 'WHERE: WHAT': one located line."""
    where, sep, what = str(e).partition(": ")
    return SpecError(Loc(where), what) if sep else SpecError(None, str(e))


def cmd_import(args) -> int:
    from runtime.checkpoint import CheckpointError
    from specc_torch.hf import HFError, import_hf

    try:
        done = import_hf(args.hf_dir, args.spec, args.out, _overrides(args))
    except (HFError, CheckpointError) as e:
        raise _user_error(e) from None
    print(f"specc hf import: {args.hf_dir} ({done['architecture']}, {done['tensors']} tensors, "
          f"{done['parameters']:,} parameters) -> {done['path']} (spec {done['spec']})")
    return 0


def cmd_export(args) -> int:
    from runtime.checkpoint import CheckpointError
    from specc_torch.hf import HFError, export_hf

    try:
        done = export_hf(args.ckpt, args.spec, args.out, _overrides(args), step=args.step,
                         allow_spec_change=args.allow_spec_change)
    except (HFError, CheckpointError) as e:
        raise _user_error(e) from None
    print(f"specc hf export: {args.ckpt} (step {done['step']}, spec {done['spec']}) -> {done['path']} "
          f"({done['architecture']}, {done['tensors']} tensors, {done['parameters']:,} parameters)")
    return 0
