"""Seconds, not only bytes: the step time of a plan on a machine profile (specc/plan/machine.py),
and the memory each GPU needs. docs/planning.md states the model; in short:

* a GEMM's time is its FLOPs over the peak for the plan's dtype times an efficiency that grows with
  its size, eff(F) = gemm · F / (F + gemm_half_flops), and a fused attention kernel's at the
  profile's `attention` share of that (1 when it says none), a batched per-head multiply's (the
  unfused attention's, CP's blocks) at its `batched_gemm` share; a memory-bound kernel's is the bytes it moves
  (the op's `memory_traffic`) over memory bandwidth · memory efficiency (CP's blocks' passes over
  their scores times the profile's `cp_blocks` share); an op costs the sum; FLOPs are those the
  kernels run (OpKind.kernel_flops: CP's blocks compute masked pairs and recompute Q K^T);
* a collective's time is the ring algorithm's: all-reduce 2(n-1)/n · bytes, all-gather,
  reduce-scatter and all-to-all (n-1)/n · bytes, over the link its group crosses (inside a node,
  or across nodes from the rank order: tp innermost, then cp, then dp, then pp, as
  runtime/parallel_state.py lays ranks out) at its bandwidth · link efficiency, plus one latency
  per ring step; a point-to-point send is bytes over the link plus one latency (inside a node
  the pipeline's sends and all-to-alls take the profile's `point_to_point` and `all_to_all` links
  when it has them; the CP ring's shift, a collective of the cp group, takes the node's link);
* on a profile with `op_overhead` (a calibrated host), every op call that runs a kernel or a
  collective costs that many seconds more, forward and backward each (and its forward again
  when recomputed): the framework's dispatch, autograd and allocation;
* only the overlaps the runtime performs, each hiding the profile's `overlap` share of the
  shorter of the collectives and the compute beside them (beside(); 1 on the datasheet profiles,
  less on a CPU host, whose cores both compute and copy): an op's collectives beside its own
  GEMMs where its `comm_hidden` says so (a column-parallel linear's backward gather, reduce-scatter or all-reduce
  beside its grad-input and weight-gradient GEMMs; the CP ring's steps beside the block
  computations), the data-parallel gradient buckets beside the last micro-batch's backward (all
  but the last bucket; at PP > 1 what is left also behind the drain, while the stages before the
  rank finish, and the tied embedding's bucket after the schedule); nothing else;
* the pipeline runs m = global batch / (micro-batch · DP) micro-batches: under 1F1B the longest
  stage's path (its m micro-batches, the forwards before it and the backwards after it, and the
  wait for its first gradient: one_f_one_b_time; (m + P - 1) micro-batch times for equal stages),
  interleaved m times the slowest rank's micro-batch plus the bubble (P - 1)/V times the mean one;
* then the exposed DP reduction, the distributed optimizer's parameter all-gather, the TP/CP
  partial-gradient all-reduces, the tied embedding's all-reduce over the pipeline's ends, and the
  optimizer step, memory-bound over the rank's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Loc, SpecError
from ..layouts import DTYPE_BYTES
from .build import OPT_BYTES
from .machine import Link

BUCKET_ELEMENTS = 4_000_000  # the runtime's data-parallel bucket (runtime/train/config.py: bucket_size)
# Adam's step per parameter element: the fp32 gradient read twice (norm, step), m and v read and
# written, the fp32 master (or fp32 parameter) read and written; 16-bit training also writes the
# 16-bit parameter copy
OPTIMIZER_BYTES_PER_ELEMENT = 4 * 2 + 8 * 2 + 4 * 2


@dataclass(frozen=True)
class Job:
    num_gpus: int
    global_batch_size: int
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True  # the runtime's default (--no-overlap-grad-reduce: after backward)
    overlap_param_gather: bool = False  # --overlap-param-gather (with the distributed optimizer)


# -- the pieces, each a closed form --------------------------------------------------------------

def gemm_time(flops: float, machine, dtype: str, kernel: str = "gemm") -> float:
    """One GEMM of `flops` FLOPs: F / (peak · gemm · F / (F + F_half)) = (F + F_half) / (peak · gemm);
    a fused attention kernel's (`kernel` "attention") at the profile's attention share of that rate,
    a batched per-head multiply's ("batched_gemm") at its batched_gemm share."""
    if flops <= 0:
        return 0.0
    rate = machine.peak(dtype) * machine.gemm_efficiency
    if kernel == "attention":
        rate *= machine.attention_efficiency
    elif kernel in ("batched_gemm", "cp_blocks"):
        rate *= machine.batched_gemm_efficiency
    return (flops + machine.gemm_half_flops) / rate


def memory_time(nbytes: float, machine, kernel: str = "gemm") -> float:
    """Memory-bound kernels moving `nbytes`; CP's blocks' passes over the scores (`kernel`
    "cp_blocks") at the profile's cp_blocks share of the rate."""
    if nbytes <= 0:
        return 0.0
    share = machine.cp_blocks_efficiency if kernel == "cp_blocks" else 1.0
    return nbytes / (machine.memory_bandwidth * machine.memory_efficiency * share)


def collective_time(kind: str, nbytes: float, n: int, link: Link, efficiency: float) -> float:
    """The ring algorithm over n ranks: all-reduce 2(n-1) steps moving 2(n-1)/n of the bytes,
    all-gather / reduce-scatter / all-to-all n-1 steps moving (n-1)/n, a send one step moving all
    of it (its matching recv runs at the same time: the links are full duplex)."""
    if n <= 1 or nbytes <= 0 or kind == "recv":
        return 0.0
    if kind == "all_reduce":
        steps, share = 2 * (n - 1), 2 * (n - 1) / n
    elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
        steps, share = n - 1, (n - 1) / n
    elif kind == "send":
        steps, share = 1, 1.0
    else:
        raise ValueError(f"unknown collective {kind}")
    return steps * link.latency + share * nbytes / (link.bandwidth * efficiency)


def group_link(machine, stride: int, n: int) -> tuple:
    """(Link, inside one node?) for a group of n ranks `stride` apart. Inside a node when the
    group's span divides the node's devices; across nodes otherwise, with as many of a node's
    NICs as the group has ranks there (every GPU has one NIC and the concurrent groups share
    them), never faster than the intra-node link."""
    dpn = machine.devices_per_node
    span = stride * n
    if span <= dpn and dpn % span == 0:
        return machine.intra_node, True
    per_node = max(1, dpn // stride) if stride < dpn else 1
    inter = machine.inter_node
    return Link(inter.name, min(machine.intra_node.bandwidth, inter.bandwidth * per_node), inter.latency), False


def beside(comm: float, compute: float, machine) -> float:
    """The exposed part of `comm` seconds of collectives issued beside `compute` seconds of work:
    comm - overlap · min(comm, compute), the form calibrate measures the profile's `overlap` in
    (a GEMM and a collective together take g + c - overlap · min(g, c)). At 1 (a GPU's copy
    engines and NICs) what fits beside the compute is hidden; at 0 nothing is; below 0 (a CPU
    host whose cores both compute and copy, and contend) running both costs more than the two
    one after the other."""
    return comm - machine.comm_overlap * min(comm, compute)


def one_f_one_b_time(forward: list, backward: list, m: int) -> float:
    """The 1F1B schedule's makespan over stages with their own forward and backward times (per
    micro-batch), m micro-batches: the longest of each stage's path. Stage k starts after the
    forwards of the stages before it, runs its m forwards and backwards, and ends before the
    backwards of the stages before it; its first backward waits for the gradient's round trip
    through the stages after it, less the P - 1 - k warmup forwards it runs meanwhile. With equal
    stages that is (m + P - 1) micro-batch times, the bubble formula's; with unequal ones the
    slowest stage's own fill and drain, not the mean's, set the bubble."""
    p = len(forward)
    return max(sum(forward[:k]) + m * (forward[k] + backward[k])
               + max(0.0, sum(forward[i] + backward[i] for i in range(k + 1, p)) - (p - 1 - k) * forward[k])
               + sum(backward[:k]) for k in range(p))


def bubble_time(pp: int, virtual: int, microbatch_time: float) -> float:
    """The pipeline's fill and drain: (P - 1)/V micro-batch times ((interleaved) 1F1B)."""
    return (pp - 1) / virtual * microbatch_time


# -- the model -----------------------------------------------------------------------------------

def predict(plan, tokens_per_sample: int, machine, job: Job) -> dict:
    """The predicted step of `plan` on `machine` for `job`, as plain data (text and JSON)."""
    s = plan.settings
    t = plan.totals
    tp, cp, pp, ep = s.tp, s.cp, s.pp, s.ep
    model = tp * cp * pp
    if job.num_gpus < 1:
        raise SpecError(Loc(f"--num-gpus {job.num_gpus}"), "must be at least 1")
    if job.num_gpus % model:
        raise SpecError(Loc(f"--num-gpus {job.num_gpus}"), f"is not a multiple of tp x cp x pp = {tp} x {cp} x {pp} "
                        f"= {model}: the data-parallel size would not be whole",
                        f"use a multiple of {model}, e.g. {model * max(1, job.num_gpus // model)}")
    dp = job.num_gpus // model
    if job.overlap_param_gather and not job.distributed_optimizer:
        raise SpecError(Loc("--overlap-param-gather"), "needs --use-distributed-optimizer (it overlaps the "
                        "distributed optimizer's parameter all-gather)", "add --use-distributed-optimizer")
    if dp % ep:
        raise SpecError(Loc(f"--num-gpus {job.num_gpus}"), f"gives a data-parallel size of {dp}, which the "
                        f"expert-parallel size {ep} does not divide", "expert parallelism is carved out of DP")
    if job.global_batch_size < 1 or job.global_batch_size % (s.micro_batch_size * dp):
        raise SpecError(Loc(f"--global-batch-size {job.global_batch_size}"), f"is not a multiple of micro-batch "
                        f"size x DP = {s.micro_batch_size} x {dp} = {s.micro_batch_size * dp}",
                        "each data-parallel rank runs whole micro-batches")
    m = job.global_batch_size // (s.micro_batch_size * dp)
    pipe = t.get("pipeline")
    virtual = pipe["virtual"] if pipe else 1
    if virtual > 1 and m % pp:
        raise SpecError(Loc(f"--global-batch-size {job.global_batch_size}"), f"gives {m} micro-batches per "
                        f"pipeline, not a multiple of the pipeline size {pp}, which the interleaved schedule needs",
                        f"use a global batch that is a multiple of {s.micro_batch_size * dp * pp}")
    dtype, elt = s.dtype, DTYPE_BYTES[s.dtype]
    eff = machine.link_efficiency
    strides = {"tp": (1, tp), "cp": (tp, cp), "ep": (tp * cp, ep), "dp": (tp * cp, dp),
               "edp": (tp * cp * ep, dp // ep), "pp": (tp * cp * dp, pp)}
    links = {axis: group_link(machine, stride, n) for axis, (stride, n) in strides.items()}

    def coll(kind, nbytes, axis):
        stride, n = strides[axis]
        link, inside = links[axis]
        # the pipeline's sends and EP's all-to-all go through torch.distributed (gloo on a CPU host);
        # the CP ring's shift is a collective (runtime.comm.ring_exchange) on the group's own transport
        if inside and (kind == "all_to_all" or (kind == "send" and axis != "cp")):
            link = (machine.point_to_point if kind == "send" else machine.all_to_all) or link
        return collective_time(kind, nbytes, n, link, eff)

    def p2p(st, way):
        """(pp seconds, tp seconds) of a stage's `way` ("send": its activation forward, and the
        all-gather of the gradient's slices that come back; "recv": the gradient back, and the
        all-gather of the activation's slices that arrive). A value replicated over TP travels as
        1/t slices, gathered over TP (runtime/pipeline.py); the rest whole."""
        whole, cut = st[f"{way}_bytes"], st.get(f"{way}_scattered_bytes", 0)
        return coll("send", whole - cut + cut / tp, "pp"), coll("all_gather", cut, "tp")

    # per stage, one micro-batch: forward, backward (recompute included), and where the time goes
    stages = pipe["stages"] if pipe else [{"stage": 0, "rank": 0, "layers": [], "send_bytes": 0, "recv_bytes": 0}]
    per_stage = [_Acc() for _ in stages]
    for stage, mult, e in _placed(plan, stages):
        _add_entry(per_stage[stage], mult, e, machine, dtype, coll)
    ranks = []
    for r in range(pp):
        acc = _Acc()
        for st, a in zip(stages, per_stage):
            if st["rank"] == r:
                acc.merge(a)
                # the activation forward to the next stage, its gradient back to the one before
                (send, gather_grad), (send_grad, gather) = p2p(st, "send"), p2p(st, "recv")
                acc.add("pp", send + send_grad, backward=False)
                acc.add("tp", gather + gather_grad, backward=False)
        ranks.append(acc)
    mb = [a.total for a in ranks]
    slowest = max(range(pp), key=lambda r: (mb[r], -r))
    mean = sum(mb) / pp
    if pp > 1 and virtual == 1:
        pipe_time = one_f_one_b_time([a.forward for a in ranks], [a.backward for a in ranks], m)
    else:  # interleaved: (P - 1)/V micro-batch times of the mean rank
        pipe_time = m * mb[slowest] + bubble_time(pp, virtual, mean)
    bubble = pipe_time - m * mb[slowest]

    # after the last micro-batch: the data-parallel reduction and the optimizer, per rank
    params = _rank_parameters(t, pp)
    grad_mode = "reduce_scatter" if job.distributed_optimizer else "all_reduce"
    tied = _tied_elements(plan, pipe) if pipe and pipe["ties"] else 0

    def dp_reduction_exposed(r: int, mode: str) -> float:
        """Seconds of rank r's data-parallel reduction past the end of the pipeline schedule, as
        runtime/ddp.py runs it. Its buckets start in index order, each once its gradients are
        in, in the last micro-batch's backward: the rank's last chunk's first (its stage's last
        backward: final_backward), then each earlier chunk's, whose last backward comes P chunk
        backwards later (interleaved 1F1B's cooldown), the rank's first chunk's last, its last
        bucket when that backward ends; expert weights' buckets follow all the dense ones (so start
        when backward ends); they queue on the link, beside the backward compute still to run
        (beside(): the profile's overlap share of it hidden). After its last backward rank r idles
        while the stages before it run theirs (the drain), which hides what is left. A bucket
        holding the weight tied across the pipeline's ends waits for the tied sum, after the
        schedule: exposed whole."""
        mine = sorted((i for i, st in enumerate(stages) if st["rank"] == r), key=lambda i: -stages[i].get("chunk", 0))
        dense_total, experts = params[r]
        held = tied if r in (0, pp - 1) else 0
        backward = [per_stage[i].backward for i in mine]
        chunk_dense = [stages[i].get("parameters", dense_total + experts) - stages[i].get("expert_parameters", experts)
                       for i in mine]
        for k, i in enumerate(mine):  # the tied weight lives on the first stage and the last
            if held and (stages[i].get("pre_process") or stages[i].get("post_process")):
                chunk_dense[k] = max(0, chunk_dense[k] - held)
        clock, total = float("-inf"), 0.0  # seconds relative to the end of the rank's last backward
        for k, elements in enumerate(chunk_dense):
            if not elements:
                continue
            begins = -sum(backward[k:]) - (pp - 1) * sum(backward[k + 1:])  # its last backward starts
            whole, last = coll(mode, elements * 4, "dp"), coll(mode, min(BUCKET_ELEMENTS, elements) * 4, "dp")
            clock = max(clock, begins) + whole - last
            clock = max(clock, begins + backward[k]) + last
            total += whole
        if experts:
            whole = coll(mode, experts * 4, "edp")
            clock, total = max(clock, 0.0) + whole, total + whole
        if total <= 0:
            return coll(mode, held * 4, "dp")
        hidden = total - max(0.0, clock)  # what ran beside backward at full overlap
        exposed = total - machine.comm_overlap * hidden
        drain = sum(per_stage[i].backward for i in range(min(r, len(stages))))
        return max(0.0, exposed - drain) + coll(mode, held * 4, "dp")
    post = []
    for r in range(pp):
        dense, experts = params[r]
        full = coll(grad_mode, dense * 4, "dp") + coll(grad_mode, experts * 4, "edp")
        if job.overlap_grad_reduce:
            dp_exposed = dp_reduction_exposed(r, grad_mode)
        else:  # every bucket after backward
            dp_exposed = full
        gather = (coll("all_gather", dense * elt, "dp") + coll("all_gather", experts * elt, "edp")
                  if job.distributed_optimizer else 0.0)
        if job.overlap_param_gather:
            # The runtime starts every bucket's gather at once, in the order the forward needs them
            # (runtime/ddp.py forward_order), and a forward waits for its module's bucket: the first
            # forward waits for the first bucket's gather (collectives of one group run in order),
            # which the pipeline's fill hides (rank r's first forward starts after the stages
            # before it ran theirs); the other buckets' gathers run beside what is left of the
            # fill and the first micro-batch's forward.
            fill = sum(per_stage[i].forward + p2p(stages[i], "send")[0] + p2p(stages[i + 1], "recv")[1]
                       for i in range(min(r, len(stages) - 1)))
            first = coll("all_gather", min(BUCKET_ELEMENTS, dense) * elt, "dp") if dense else \
                coll("all_gather", min(BUCKET_ELEMENTS, experts) * elt, "edp")
            first = min(first, gather)
            gather = beside(first, fill, machine) + \
                beside(gather - first, max(0.0, fill - first) + ranks[r].forward, machine)
        share = (dense + experts) / max(1, t["parameters"])
        sync = coll("all_reduce", t.get("tp_partial_grad_parameters", 0) * 4 * share, "tp") + \
            coll("all_reduce", t.get("cp_partial_grad_parameters", 0) * 4 * share, "cp")
        tie = 0.0
        if pipe and pipe["ties"] and r in (0, pp - 1):
            tied = _tied_elements(plan, pipe)
            tie = collective_time("all_reduce", tied * 4, 2, group_link(machine, tp * cp * dp * (pp - 1), 2)[0], eff)
        opt_elements = (dense / dp + experts / (dp // ep)) if job.distributed_optimizer else dense + experts
        per_element = OPTIMIZER_BYTES_PER_ELEMENT + (elt if dtype != "fp32" else 0)
        optimizer = memory_time(opt_elements * per_element, machine) / machine.optimizer_efficiency
        post.append({"dp_grad_reduce": dp_exposed, "dp_param_gather": gather, "partial_grad_sync": sync,
                     "tied_embedding_sync": tie, "optimizer": optimizer})
    last_rank = max(range(pp), key=lambda r: (sum(post[r].values()), -r))
    step = pipe_time + sum(post[last_rank].values())

    crit = ranks[slowest]
    breakdown = {"compute": m * crit.parts["compute"], "memory_bound": m * crit.parts["memory"]}
    if machine.op_overhead:
        breakdown["op_overhead"] = m * crit.parts.get("overhead", 0.0)
    for axis in ("tp", "cp", "ep", "pp"):
        breakdown[f"{axis}_comm"] = m * crit.parts.get(axis, 0.0)
    breakdown["pipeline_bubble"] = bubble
    breakdown.update(post[last_rank])
    memory = _memory(plan, machine, job, dp, m, params)
    flops_model = t["flops_per_step"] * m / pp  # per GPU per step (Megatron's model FLOPs)
    flops_hw = (t["flops_per_step"] + t.get("recompute_flops", 0)) * m / pp
    peak = machine.peak(dtype)
    out = {
        "machine": machine.name, "device": machine.device, "num_gpus": job.num_gpus,
        "layout": {"tp": tp, "cp": cp, "pp": pp, "vpp": virtual, "ep": ep, "dp": dp,
                   "micro_batch_size": s.micro_batch_size, "sp": s.sp,
                   "recompute": s.recompute_granularity or "none",
                   "distributed_optimizer": job.distributed_optimizer,
                   "overlap_grad_reduce": job.overlap_grad_reduce, "overlap_param_gather": job.overlap_param_gather},
        "global_batch_size": job.global_batch_size, "micro_batches": m,
        "step_time_s": step, "tokens_per_s": job.global_batch_size * tokens_per_sample / step,
        "tflops_per_gpu": flops_model / step / 1e12,
        "tflops_per_gpu_with_recompute": flops_hw / step / 1e12,
        "mfu": flops_model / step / peak, "hfu": flops_hw / step / peak, "peak_tflops": peak / 1e12,
        "dtype": dtype,
        "breakdown_s": breakdown,
        "links": {axis: {"name": links[axis][0].name, "intra_node": links[axis][1],
                         "bandwidth": links[axis][0].bandwidth}
                  for axis in strides if strides[axis][1] > 1 and (axis != "edp" or ep > 1)},
        "memory": memory,
    }
    out["binding"] = _binding(out)
    return out


class _Acc:
    """Seconds of one micro-batch on a stage or rank, by part."""

    def __init__(self):
        self.forward = 0.0
        self.backward = 0.0
        self.parts = {"compute": 0.0, "memory": 0.0}

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def add(self, part: str, seconds: float, backward: bool) -> None:
        if seconds <= 0:
            return
        self.parts[part] = self.parts.get(part, 0.0) + seconds
        if backward:
            self.backward += seconds
        else:
            self.forward += seconds

    def merge(self, other) -> None:
        self.forward += other.forward
        self.backward += other.backward
        for k, v in other.parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v


def _add_entry(acc: _Acc, mult: float, e, machine, dtype: str, coll) -> None:
    """One plan entry, `mult` instances, into a stage's micro-batch."""
    f_fwd, f_bwd = e.kernel_flops or e.flops
    gemm_f = gemm_time(f_fwd, machine, dtype, e.kernel)
    gemm_b = 2 * gemm_time(f_bwd / 2, machine, dtype, e.kernel) if f_bwd else 0.0  # grad-input and weight-gradient
    gemm_r = gemm_f if e.recomputed else 0.0
    hidden_f, hidden_b = e.comm_hidden
    fwd_axes, bwd_axes = e.comm_axes
    n_re = len(e.forward) if e.recomputed else 0
    pieces = (  # (GEMM seconds, collectives, axes, hidden share, backward?)
        (gemm_f, e.forward, fwd_axes, hidden_f, False),
        (gemm_r, e.backward[:n_re], bwd_axes[:n_re], hidden_f, True),
        (gemm_b, e.backward[n_re:], bwd_axes[n_re:], hidden_b, True),
    )
    for gemm, colls, axes, hidden, backward in pieces:
        acc.add("compute", mult * gemm, backward)
        times = [(axis, coll(kind, nbytes, axis)) for (kind, nbytes), axis in zip(colls, axes)]
        total = sum(x for _, x in times)
        exposed = beside(total, hidden * gemm, machine)
        for axis, x in times:
            if total > 0:
                acc.add(axis, mult * exposed * x / total, backward)
    mem_f, mem_b = e.memory
    acc.add("memory", mult * memory_time(mem_f, machine, e.kernel), False)
    acc.add("memory", mult * memory_time(mem_b, machine, e.kernel), True)
    if machine.op_overhead:
        calls_f, calls_b = op_calls(e)
        acc.add("overhead", mult * calls_f * machine.op_overhead, False)
        acc.add("overhead", mult * calls_b * machine.op_overhead, True)


def op_calls(e) -> tuple:
    """(forward, backward) calls of one instance of a plan entry that pay the framework's per-op
    overhead: a call that runs a matrix multiply, a memory-bound kernel or a collective (a view
    runs none); backward also runs the recomputed forward."""
    f_fwd, f_bwd = e.flops
    mem_f, mem_b = e.memory
    fwd = 1 if (f_fwd or mem_f or e.forward) else 0
    if e.recomputed:  # its backward traffic and collectives list the recomputed forward's first
        mem_b, bwd_colls = mem_b - mem_f, e.backward[len(e.forward):]
    else:
        bwd_colls = e.backward
    bwd = 1 if (f_bwd or mem_b > 0 or bwd_colls) else 0
    return fwd, bwd + (fwd if e.recomputed else 0)


def _placed(plan, stages: list):
    """(stage, instances per micro-batch, entry) for every plan entry: a folded repeated layer's
    entry on every stage, times the stage's layers; the ops before the block on the first stage,
    after it on the last."""
    pipe = plan.totals.get("pipeline")
    if not pipe:
        for e in plan.entries:
            yield 0, e.count, e
        return
    block = pipe["block"]
    layer_stage = {i: st["stage"] for st in stages for i in st["layers"]}
    n_layers = len(layer_stage)
    folded, seen_block = block + ".*.", False
    for e in plan.entries:
        if e.name.startswith(folded):
            seen_block = True
            per_layer = e.count / n_layers
            for st in stages:
                yield st["stage"], per_layer * len(st["layers"]), e
        elif e.name.startswith(block + ".") and e.name[len(block) + 1:].split(".", 1)[0].isdigit():
            seen_block = True
            yield layer_stage[int(e.name[len(block) + 1:].split(".", 1)[0])], e.count, e
        else:
            yield (len(stages) - 1 if seen_block else 0), e.count, e


def _rank_parameters(totals: dict, pp: int) -> list:
    """[(dense, expert) parameter elements] per pipeline rank."""
    if "pipeline" in totals:
        return [(r["parameters"] - r["expert_parameters"], r["expert_parameters"]) for r in totals["pipeline"]["ranks"]]
    experts = totals.get("expert_parameters", 0)
    return [(totals["parameters"] - experts, experts)]


def _tied_elements(plan, pipe: dict) -> int:
    names = {tie["weight"] for tie in pipe["ties"]}
    total = 0
    for e in plan.entries:
        for wname, shape in e.weights:
            if f"{e.name}.{wname}" in names:
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def _memory(plan, machine, job: Job, dp: int, m: int, params: list) -> dict:
    """Bytes per GPU, for the fullest pipeline rank: weights, fp32 gradients (the runtime's
    main_grad buffer), Adam's state (fp32 master weights, m, v; over DP with the distributed
    optimizer, expert weights' over DP / EP), the activations the schedule holds at its peak
    with m micro-batches (what they keep for backward, plus the largest working set of one
    micro-batch's backward beyond it: a recompute region materialised again, the loss's
    temporaries; plan totals' `activation_working_bytes`), and the framework allowance."""
    from ..passes.pipeline import in_flight

    s, t = plan.settings, plan.totals
    elt = DTYPE_BYTES[s.dtype]
    pipe = t.get("pipeline")
    rows = []
    for r, (dense, experts) in enumerate(params):
        if pipe:
            mine = [st for st in pipe["stages"] if st["rank"] == r]
            flight = in_flight(_Rank(r), pipe["size"], pipe["virtual"], m)
            acts = max(st["activation_bytes"] for st in mine) * flight
            working = max(st["activation_working_bytes"] for st in mine)
        else:
            flight, acts, working = 1, t["activation_bytes"], t["activation_working_bytes"]
        opt_per = OPT_BYTES[s.dtype]
        optimizer = (dense * opt_per / dp + experts * opt_per / (dp // s.ep)) if job.distributed_optimizer \
            else (dense + experts) * opt_per
        row = {"pipeline_rank": r, "weights": (dense + experts) * elt, "gradients": (dense + experts) * 4,
               "optimizer": round(optimizer), "activations": acts + working, "activations_kept": acts,
               "activations_working": working, "micro_batches_in_flight": flight,
               "framework": round(machine.framework_memory_bytes)}
        row["total"] = sum(row[k] for k in ("weights", "gradients", "optimizer", "activations", "framework"))
        rows.append(row)
    fullest = max(rows, key=lambda x: (x["total"], -x["pipeline_rank"]))
    return {**fullest, "capacity": round(machine.memory_bytes), "fits": fullest["total"] <= machine.memory_bytes,
            "optimizer_sharded_over_dp": job.distributed_optimizer}


@dataclass(frozen=True)
class _Rank:
    rank: int


LABELS = {
    "compute": "compute (GEMMs)", "memory_bound": "memory-bound kernels (norms, elementwise, softmax)",
    "op_overhead": "per-op framework overhead (dispatch, autograd)",
    "tp_comm": "tp collectives", "cp_comm": "cp collectives", "ep_comm": "ep all-to-all",
    "pp_comm": "pp sends", "pipeline_bubble": "pipeline bubble", "dp_grad_reduce": "dp gradient reduction",
    "dp_param_gather": "dp parameter all-gather", "partial_grad_sync": "tp/cp partial-gradient all-reduce",
    "tied_embedding_sync": "tied embedding all-reduce", "optimizer": "optimizer step (memory-bound)",
}
_LINK_OF = {"tp_comm": "tp", "cp_comm": "cp", "ep_comm": "ep", "pp_comm": "pp", "dp_grad_reduce": "dp",
            "dp_param_gather": "dp", "partial_grad_sync": "tp"}


def label(pred: dict, part: str) -> str:
    axis = _LINK_OF.get(part)
    link = pred["links"].get(axis) if axis else None
    return LABELS[part] + (f" over {link['name']}" if link else "")


def _binding(pred: dict) -> str:
    """What bounds the step: memory capacity when it does not fit, else the largest part."""
    mem = pred["memory"]
    if not mem["fits"]:
        return (f"memory capacity: does not fit ({mem['total'] / 2**30:.1f} GiB needed on pipeline rank "
                f"{mem['pipeline_rank']}, {mem['capacity'] / 2**30:.1f} GiB per GPU)")
    part = max(pred["breakdown_s"], key=lambda k: (pred["breakdown_s"][k], k))
    return label(pred, part)
