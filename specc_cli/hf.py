"""`specc hf import HF_DIR --spec SPEC --out CKPT` and `specc hf export CKPT --spec SPEC --out HF_DIR`:
Hugging Face safetensors <-> specc checkpoints, by the mapping the spec declares under `hf:`
(docs/checkpoints.md). The runtime (torch, safetensors) is imported when a command runs."""

from __future__ import annotations

from .convert_args import add_export_source, add_spec_and_out, overrides_of, user_error

SPEC_HELP = "the spec whose hf: mapping to use"
SET_HELP = "override a config value of the spec; repeatable"


def add_parsers(sub) -> None:
    p = sub.add_parser("hf", help="import or export Hugging Face checkpoints (safetensors) by the spec's hf: mapping",
                       description="Convert between a Hugging Face model directory (config.json, model.safetensors) "
                       "and a specc checkpoint, by the mapping the spec declares under hf:.")
    hf_sub = p.add_subparsers(dest="hf_command", metavar="ACTION")
    hf_sub.required = True

    c = hf_sub.add_parser("import", help="HF_DIR -> a new specc checkpoint directory (step 0), loadable at any TP")
    c.add_argument("hf_dir", metavar="HF_DIR", help="a Hugging Face model directory")
    add_spec_and_out(c, SPEC_HELP, SET_HELP)
    c.set_defaults(func=cmd_import)

    c = hf_sub.add_parser("export", help="a specc checkpoint -> a new Hugging Face model directory")
    add_export_source(c)
    add_spec_and_out(c, SPEC_HELP, SET_HELP)
    c.set_defaults(func=cmd_export)


def cmd_import(args) -> int:
    from runtime.checkpoint import CheckpointError
    from specc_torch.hf import HFError, import_hf

    try:
        done = import_hf(args.hf_dir, args.spec, args.out, overrides_of(args))
    except (HFError, CheckpointError) as e:
        raise user_error(e) from None
    print(f"specc hf import: {args.hf_dir} ({done['architecture']}, {done['tensors']} tensors, "
          f"{done['parameters']:,} parameters) -> {done['path']} (spec {done['spec']})")
    return 0


def cmd_export(args) -> int:
    from runtime.checkpoint import CheckpointError
    from specc_torch.hf import HFError, export_hf

    try:
        done = export_hf(args.ckpt, args.spec, args.out, overrides_of(args), step=args.step,
                         allow_spec_change=args.allow_spec_change)
    except (HFError, CheckpointError) as e:
        raise user_error(e) from None
    print(f"specc hf export: {args.ckpt} (step {done['step']}, spec {done['spec']}) -> {done['path']} "
          f"({done['architecture']}, {done['tensors']} tensors, {done['parameters']:,} parameters)")
    return 0
