"""Render a Plan as aligned text (for people and diff) and as JSON (for tools). Both are
byte-stable: no timestamps, no absolute paths, no dict-order or hash-seed dependence."""

from __future__ import annotations

import json
import os

from ..ops import OPS

_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "send": "SEND", "recv": "RECV"}


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _colls(items: list) -> str:
    return " + ".join(f"{_SHORT[k]} {human_bytes(b)}" for k, b in items) or "-"


def _converts(e) -> bool:
    return OPS[e.kind].converts()


def plan_text(plan) -> str:
    s = plan.settings
    lines = [
        f"# specc plan {plan.spec_name} ({os.path.basename(plan.spec_path)})",
        f"# specc {plan.version}  spec sha256 {plan.spec_hash[:16]}",
        f"# settings: {s.describe()}",
        f"# bytes at {s.dtype} (--dtype bf16|fp16|fp32); specc train runs at fp32 unless --bf16 or --fp16",
        "# per rank; AR all-reduce, AG all-gather, RS reduce-scatter" + ("; SEND/RECV point-to-point" if s.cp > 1 else "")
        + ("; A2A all-to-all (uniform routing)" if s.ep > 1 else "")
        + "; bytes as the collective moves them",
        "",
    ]
    header = ("op", "impl", "layouts", "forward", "backward", "saved", "notes")
    rows = [header]
    for e in plan.entries:
        name = e.name + (f"  x{e.count}" if e.count > 1 else "")
        lay = f"{','.join(e.layouts_in) or '-'} -> {','.join(e.layouts_out) or '-'}"
        rows.append((name, "boundary" if _converts(e) else e.impl, lay, _colls(e.forward), _colls(e.backward),
                     human_bytes(e.saved) if e.saved else "-", "; ".join(e.notes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    lines[-len(rows):] = [ln.rstrip() for ln in lines[-len(rows):]]
    t = plan.totals
    lines += ["", f"totals per step (one micro-batch of {s.micro_batch_size}, forward + backward)"]
    for kind, c in t["collectives"].items():
        lines.append(f"  {kind:<16}{c['count']:>6} x   {human_bytes(c['bytes']):>12}")
    gs = t["grad_sync"]["all_reduce"]
    if gs["count"]:
        label = "tp grad sync" if "cp_partial_grad_parameters" not in t else "grad sync"
        what = (f"(all-reduce of {t['tp_partial_grad_parameters']:,} tp-partial gradient elements, once per step)"
                if "cp_partial_grad_parameters" not in t else
                f"(all-reduces of {t['tp_partial_grad_parameters']:,} tp-partial and "
                f"{t['cp_partial_grad_parameters']:,} cp-partial gradient elements, once per step each)")
        if "replicated_head_grad_elements" in t:  # summed in the tp buffer
            what = what[:-1] + (f", with {t['replicated_head_grad_elements']:,} zero-padded elements of "
                                "replicated heads' gradients in the tp one)")
        lines.append(f"  {label:<16}{gs['count']:>6} x   {human_bytes(gs['bytes']):>12}   {what}")
    lines += [
        f"  parameters      {t['parameters']:>14,}   {human_bytes(t['parameter_bytes']):>12}",
        f"  gradients                       {human_bytes(t['gradient_bytes']):>12}   (fp32)",
        f"  optimizer state                 {human_bytes(t['optimizer_bytes']):>12}   (Adam, not sharded over DP)",
        f"  activations                     {human_bytes(t['activation_bytes']):>12}   (kept for backward)",
        f"  activations working set         {human_bytes(t['activation_working_bytes']):>12}   (held beyond them at "
        f"the fullest moment of backward: a recomputed region again, the loss's temporaries)",
        f"  matmul FLOPs    {t['flops_per_step']:>14,}   ({t['flops']['forward']:,} forward + "
        f"{t['flops']['backward']:,} backward)",
    ]
    if "expert_parameters" in t:
        lines.insert(len(lines) - 4, f"  of which experts{t['expert_parameters']:>14,}   "
                     f"{human_bytes(t['expert_parameters'] * t['parameter_bytes'] // max(1, t['parameters'])):>12}   "
                     f"(Adam state {human_bytes(t['expert_optimizer_bytes'])}; data-parallel over dp/ep ranks)")
    if t.get("recompute_flops"):
        share = 100 * t["recompute_flops"] / max(t["flops_per_step"], 1)
        lines.append(f"  recompute FLOPs {t['recompute_flops']:>14,}   (the recomputed forward, run again in backward: "
                     f"+{share:.1f}% of the step's matmul FLOPs)")
    if plan.groups:
        per = t["activation_bytes_per_layer"]
        if per and len(set(per.values())) > 1:  # layers of several modules (a hybrid pattern)
            lines.append(f"  activations per layer           {human_bytes(min(per.values())):>12} to "
                         f"{human_bytes(max(per.values()))} (the layers differ)")
        elif per:
            first = next(iter(per.values()))
            lines.append(f"  activations per layer           {human_bytes(first):>12}")
        for pat, n in sorted(plan.groups.items()):
            lines.append(f"  {pat} folds {n} identical instances")
    if "pipeline" in t:
        lines += _pipeline_lines(t["pipeline"], s)
    choices: dict = {}
    for e in plan.entries:
        if not _converts(e):
            choices[(e.impl, e.impl_reason)] = choices.get((e.impl, e.impl_reason), 0) + e.count
    lines += ["", "implementations (why each was chosen)"]
    for (impl, reason), n in sorted(choices.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {impl:<9}{n:>5} ops   {reason}")
    return "\n".join(lines) + "\n"


def _pipeline_lines(pipe: dict, s) -> list:
    v = pipe["virtual"]
    chunks = f", {v} model chunks per rank (interleaved)" if v > 1 else ""
    lines = ["", f"pipeline: {pipe['size']} stages of {pipe['block']}{chunks}, layers placed {pipe['placement']}; "
             f"schedule {pipe['schedule']}"]
    header = ("stage", "rank", "layers", "ends", "parameters", "optimizer", "activations/mb", "send/mb", "recv/mb")
    rows = [header]
    for st in pipe["stages"]:
        layers = st["layers"]
        ends = "+".join(x for x, on in (("embedding", st["pre_process"]), ("output", st["post_process"])) if on) or "-"
        rows.append((str(st["stage"]), str(st["rank"]), f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0]),
                     ends, f"{st['parameters']:,}", human_bytes(st["optimizer_bytes"]),
                     human_bytes(st["activation_bytes"]), human_bytes(st["send_bytes"]) if st["send_bytes"] else "-",
                     human_bytes(st["recv_bytes"]) if st["recv_bytes"] else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    what = ("1F1B: stage i holds min(P - i, m) micro-batches at its peak" if v == 1 else
            "interleaved 1F1B: rank r holds (V-1)P + 2(P-1-r) + 1 chunk micro-batches at its peak, each counted "
            "as its largest chunk's")
    lines.append(f"  peak activations per rank ({what}; m >= 2P, a multiple of P):")
    for r in pipe["ranks"]:
        lines.append(f"    rank {r['rank']}: {r['in_flight']} in flight x activations = "
                     f"{human_bytes(r['peak_activation_bytes'])} (+ {human_bytes(r['activation_working_bytes'])} "
                     f"working set); parameters {r['parameters']:,}, optimizer "
                     f"{human_bytes(r['optimizer_bytes'])}")
    bubble = ", ".join(f"m={m}: {f:.3f}" for m, f in pipe["bubble"].items())
    lines.append(f"  bubble (P-1)/(V*m+P-1): {bubble}")
    lines.append(f"  p2p per micro-batch: the send/mb tensor forward, its gradient (same bytes) backward; "
                 f"micro-batch of {s.micro_batch_size}")
    for tie in pipe["ties"]:
        lines.append(f"  {tie['weight']} is held by the first and last stage ({tie['copy']} uses the copy); "
                     f"their gradients are all-reduced over the embedding group each step")
    return lines


def plan_dict(plan) -> dict:
    s = plan.settings
    return {
        "specc_version": plan.version,
        "spec": {"name": plan.spec_name, "file": os.path.basename(plan.spec_path), "sha256": plan.spec_hash},
        "settings": s.as_dict(),
        "ops": [
            {"name": e.name, "count": e.count, "kind": e.kind, "impl": e.impl, "impl_reason": e.impl_reason,
             "layouts_in": e.layouts_in, "layouts_out": e.layouts_out,
             "forward": [{"collective": k, "bytes": b} for k, b in e.forward],
             "backward": [{"collective": k, "bytes": b} for k, b in e.backward],
             "saved_bytes": e.saved, "notes": e.notes,
             "weights": {name: list(shape) for name, shape in e.weights},
             "flops": {"forward": e.flops[0], "backward": e.flops[1]}}
            for e in plan.entries
        ],
        "groups": dict(sorted(plan.groups.items())),
        "totals": plan.totals,
    }


def plan_json(plan) -> str:
    return json.dumps(plan_dict(plan), indent=2, sort_keys=False) + "\n"


def prediction_text(pred: dict) -> str:
    """The time model's section of `specc plan --machine M` (specc/plan/time.py)."""
    from .time import label

    lay, mem = pred["layout"], pred["memory"]
    vpp = f" x vpp {lay['vpp']}" if lay["vpp"] > 1 else ""
    ep = f" (ep {lay['ep']} inside dp)" if lay["ep"] > 1 else ""
    step = pred["step_time_s"]
    lines = [
        "",
        f"predicted step on {pred['machine']} ({pred['device']}): {pred['num_gpus']} GPUs = tp {lay['tp']} x cp "
        f"{lay['cp']} x pp {lay['pp']}{vpp} x dp {lay['dp']}{ep}; global batch {pred['global_batch_size']} = "
        f"{pred['micro_batches']} micro-batches of {lay['micro_batch_size']} per data-parallel rank",
        f"  step time          {step:12.4f} s",
        f"  tokens/s           {pred['tokens_per_s']:12,.0f}",
        f"  TFLOP/s per GPU    {pred['tflops_per_gpu']:12.1f}   model FLOPs (Megatron's count); "
        f"{pred['tflops_per_gpu_with_recompute']:.1f} with recompute's",
        f"  MFU                {100 * pred['mfu']:11.1f}%   of {pred['peak_tflops']:.1f} TFLOP/s ({pred['dtype']}); "
        f"{100 * pred['hfu']:.1f}% with recompute's FLOPs",
        "  where the step goes:",
    ]
    for part, seconds in pred["breakdown_s"].items():
        if seconds > 0:
            lines.append(f"    {label(pred, part):<62}{seconds:10.4f} s  {100 * seconds / step:5.1f}%")
    lines.append(f"  binds: {pred['binding']}")
    shard = f"sharded over dp {lay['dp']}" if mem["optimizer_sharded_over_dp"] else \
        "not sharded (--use-distributed-optimizer shards it over dp)"
    where = f" (pipeline rank {mem['pipeline_rank']}, the fullest)" if lay["pp"] > 1 else ""
    lines += [
        f"  memory per GPU{where}:",
        f"    weights            {human_bytes(mem['weights']):>12}",
        f"    gradients          {human_bytes(mem['gradients']):>12}   (fp32 main_grad buffer)",
        f"    optimizer state    {human_bytes(mem['optimizer']):>12}   (Adam, {shard})",
        f"    activations        {human_bytes(mem['activations']):>12}   ({mem['micro_batches_in_flight']} "
        f"micro-batch{'es' if mem['micro_batches_in_flight'] != 1 else ''} in flight at the schedule's peak, "
        f"and {human_bytes(mem['activations_working'])} working set of one backward)",
        f"    framework          {human_bytes(mem['framework']):>12}   (allowance: CUDA context, NCCL, workspaces)",
        f"    total              {human_bytes(mem['total']):>12}   of {human_bytes(mem['capacity'])}: "
        + ("fits" if mem["fits"] else "DOES NOT FIT"),
    ]
    return "\n".join(lines) + "\n"
