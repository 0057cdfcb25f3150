"""`specc megatron import MEGATRON_DIR --spec SPEC --out CKPT` and `specc megatron export CKPT --spec
SPEC --out MEGATRON_DIR`: Megatron Core checkpoints (torch_dist, or the legacy torch format on
import) <-> specc checkpoints, by the names the spec declares under megatron.checkpoint
(docs/checkpoints.md#megatron-core-checkpoints): weights, and Adam's state where both sides have
it. The runtime is imported when a command runs."""

from __future__ import annotations

from .convert_args import add_export_source, add_spec_and_out, overrides_of, user_error

SPEC_HELP = "the spec whose megatron.checkpoint names to use"
SET_HELP = "override a config value of the spec (vocab_size: Megatron's padded one); repeatable"


def add_parsers(sub) -> None:
    p = sub.add_parser("megatron", help="import or export Megatron Core checkpoints (torch_dist; legacy torch on "
                       "import) by the spec's megatron.checkpoint names",
                       description="Convert between a Megatron Core save directory (latest_checkpointed_iteration.txt "
                       "and iter_N/) and a specc checkpoint: the weights, and the Adam state where both sides have it.")
    m_sub = p.add_subparsers(dest="megatron_command", metavar="ACTION")
    m_sub.required = True

    c = m_sub.add_parser("import", help="MEGATRON_DIR -> a new specc checkpoint directory (step N: the iteration)")
    c.add_argument("megatron_dir", metavar="MEGATRON_DIR",
                   help="a Megatron save directory (its latest iteration) or one iter_N/ folder; torch_dist or the "
                   "legacy mp_rank_*/model_optim_rng.pt, at any TP/PP")
    add_spec_and_out(c, SPEC_HELP, SET_HELP)
    c.add_argument("--iteration", type=int, default=None, metavar="N", help="import iter_N instead of the latest")
    c.add_argument("--no-load-optim", action="store_true",
                   help="leave its optimizer state (which is otherwise converted: Adam's moments, fp32 master weights "
                   "and step count, torch_dist only)")
    c.set_defaults(func=cmd_import)

    c = m_sub.add_parser("export", help="a specc checkpoint -> a new Megatron Core torch_dist save directory")
    add_export_source(c)
    add_spec_and_out(c, SPEC_HELP, SET_HELP)
    c.set_defaults(func=cmd_export)


def cmd_import(args) -> int:
    from runtime.checkpoint import CheckpointError
    from specc_torch.hf import HFError
    from specc_torch.megatron_ckpt import MegatronError, import_megatron

    try:
        done = import_megatron(args.megatron_dir, args.spec, args.out, overrides_of(args), iteration=args.iteration,
                               optimizer_state=not args.no_load_optim)
    except (MegatronError, HFError, CheckpointError) as e:
        raise user_error(e) from None
    if done["optimizer"] and not done["optimizer_state"]:
        why = "--no-load-optim" if args.no_load_optim else "its args hold no data position"
        print(f"note: {args.megatron_dir} also holds optimizer state, which is not converted ({why})")
    extra = ""
    if done["optimizer_state"]:
        extra = (f"; its optimizer state ({', '.join(done['optimizer_state'])}) at step {done['optimizer_step']}, "
                 f"{done['data']['consumed_samples']:,} samples consumed")
    print(f"specc megatron import: {args.megatron_dir} ({done['format']}, {done['tensors']} tensors, "
          f"{done['parameters']:,} parameters) -> {done['path']} (spec {done['spec']}, step {done['step']}{extra})")
    return 0


def cmd_export(args) -> int:
    from runtime.checkpoint import CheckpointError
    from specc_torch.hf import HFError
    from specc_torch.megatron_ckpt import MegatronError, export_megatron

    try:
        done = export_megatron(args.ckpt, args.spec, args.out, overrides_of(args), step=args.step,
                               allow_spec_change=args.allow_spec_change)
    except (MegatronError, HFError, CheckpointError) as e:
        raise user_error(e) from None
    print(f"specc megatron export: {args.ckpt} (step {done['step']}, spec {done['spec']}) -> {done['path']} "
          f"(torch_dist, {done['tensors']} tensors, {done['parameters']:,} parameters; {done['optimizer']})")
    return 0
