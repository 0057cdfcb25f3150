"""`specc calibrate [--ranks N] [-o PROFILE.yaml]`: measure the machine this runs on with the
project's own runtime and write a machine profile that `specc plan --machine PROFILE.yaml` reads
(specc/plan/machine.py; docs/planning.md, "Calibrating").

N ranks start as `specc train --nproc-per-node N` would start them (torch.distributed on gloo,
the data-parallel group's transport picked by runtime.ProcessGroups: shared memory when the host
has a core per rank), each with the threads a training rank gets (cores / N), and measure at the
same time, so ranks sharing cores measure the share they get:

* GEMM time per dtype of the matrix multiplies a linear layer runs in training, at the shapes of
  a transformer's (tokens M = 2n, features n to 3n and 4n and back, for several n): the forward
  x W^T, the input gradient dY W and the weight gradient dY^T X, each its own point, fitted
  (Theil-Sen, as every fit here) to the time model's t = (F + F_half) / R, so R is the rate
  training's GEMMs reach (efficiency 1) and F_half a kernel's fixed cost in FLOPs (from fp32).
  Square GEMMs alone overstate it: the rectangular and transposed ones run slower;
* fused attention (runtime.CoreAttention on torch's SDPA, causal, forward and backward) at a few
  sequence lengths and head sizes, fp32: its FLOPs as the plan counts them (s^2/2 pairs) over
  its time, against the fp32 GEMM rate, is the profile's `efficiency.attention`;
* batched per-head matrix multiplies (torch.matmul over [batch x heads, rows, head size], the
  products of the unfused attention and of runtime/context_parallel.py's blocks: QK^T and PV
  forward, the four gradients backward) at a few block and head sizes, fp32: the same ratio, the
  profile's `efficiency.batched_gemm`;
* context parallelism's blocks (runtime.context_parallel_attention on one rank: the local s x s
  block, causal (masked) and not, forward and backward, fp32, at a few sizes): what is left of the
  time after the GEMMs the plan counts for them (at the batched rate) and the op's overhead is
  their passes over the scores; the bytes the plan counts for those passes over it, against the
  memory bandwidth, is `efficiency.cp_blocks` (on a CPU the exponentials, of masked scores most,
  run below the memory's speed);
* memory-bound kernels: the kinds a transformer layer runs besides its GEMMs (an add, a GELU, a
  dropout, a softmax and a layer norm) over activation-sized tensors, bytes read and written
  (the plan's `memory_traffic` count: a dropout also writes its one-byte mask) over time; the
  profile's bandwidth is the median rate (efficiency 1). On a CPU these are not all bound by
  memory (the GELU's and softmax's exponentials, the dropout's random numbers): the median of
  the kinds the model runs, not the add's rate alone, is what its traffic moves at;
* the all-reduce over the N ranks by size: fitted to the ring's t = 2(N-1) latency +
  2(N-1)/N bytes / bandwidth (the one link of one host: intra- and inter-node alike);
* point-to-point sends by size, each rank sending to the next and receiving from the one before
  at once through runtime.comm.send_recv (as the pipeline's sends go): fitted to t = latency +
  bytes / bandwidth, the profile's `point_to_point` link (gloo's sends do not take the shared
  memory the collectives use; the CP ring's shift, runtime.comm.ring_exchange, does, and the
  model charges it the intra-node link); and the all-to-all over the N ranks by size
  (runtime.comm.all_to_all, EP's) to the ring form's (N-1) latency + (N-1)/N bytes / bandwidth,
  the profile's `all_to_all` link (gloo's own too);
* the optimizer step (the gradient's norm and torch's fused AdamW, the runtime's, over a flat fp32
  buffer): the bytes the time model counts for it over its time, against the memory bandwidth,
  is `efficiency.optimizer`;
* the framework's cost per op call: forward and backward of chains of k tiny runtime.LayerNorm
  calls (a few elements each, so the kernels cost next to nothing), fitted to t = a + k c; half
  of c is `op_overhead`, the seconds an op call costs each way beyond its kernels.

At every point the fastest of a few repeats counts, and of the ranks the slowest. Imports torch
when it runs.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time

from specc.errors import Loc, SpecError
from specc.ops.attention import cp_block_flops, cp_block_pass_bytes, cp_computed_pairs
from specc.plan.time import OPTIMIZER_BYTES_PER_ELEMENT

GEMM_SIZES = {"fp32": (64, 128, 192, 256, 384), "bf16": (32, 64, 128),
              "fp16": (32, 64, 128)}  # n; 16-bit matmuls are slow on CPUs without matrix units
# a linear layer's (M tokens, K in, N out) in units of n: attention's projections, the MLP's up and down
LAYER_SHAPES = ((2, 1, 1), (2, 1, 3), (2, 1, 4), (2, 4, 1))
GEMM_VARIANTS = ("forward", "input gradient", "weight gradient")
ATTENTION_SHAPES = ((256, 2, 8, 32), (256, 2, 4, 64), (512, 1, 4, 64))  # (sequence, batch, heads, head size)
# batched per-head products (batch x heads, rows, head size): the unfused attention's and CP's blocks
BATCHED_SHAPES = ((16, 64, 32), (16, 128, 64), (8, 256, 64), (8, 128, 128))
CP_BLOCK_SHAPES = ((128, 2, 8, 32), (256, 1, 8, 64), (128, 2, 4, 64))  # (local sequence, batch, heads, head size)
DTYPES = ("fp32", "bf16", "fp16")
ELEMENTWISE = (1 << 18, 1 << 20)  # elements: activation-sized tensors of small models
ALL_REDUCE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24)
SEND_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
ALL_TO_ALL_BYTES = SEND_BYTES
OP_CHAINS = (8, 32, 64)  # op calls per chain
OVERLAP_POINTS = ((256, 1 << 20), (384, 1 << 22), (512, 1 << 22))  # (GEMM n, all-reduce bytes)
OPTIMIZER_ELEMENTS = (1 << 20, 1 << 22)  # parameters (fp32) of the timed optimizer step


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs of fn() after one warm-up, every rank starting together (the
    slowest rank counts). The fastest, not the median: on a host shared with other jobs a run
    the scheduler interrupted is slower by the interruption, which is not the machine's rate
    (bench/plan_predict.py takes the fastest training step likewise)."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _slowest(min(times))


def _fit(xs: list, ys: list) -> tuple:
    """y = a + b x, (a, b), by Theil and Sen: b the median of the slopes between every two points,
    a the median of y - b x. A point the scheduler slowed (one GEMM size interrupted on a shared
    host) moves it little; least squares would follow the largest point, slowed or not."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    b = statistics.median(slopes)
    return statistics.median(y - b * x for x, y in zip(xs, ys)), b


def _rank(rank: int, world: int, port: int, quick: bool, out: dict) -> None:
    import torch
    import torch.distributed as dist

    from runtime import comm
    from runtime.attention import CoreAttention
    from runtime.context_parallel import context_parallel_attention
    from runtime.layers import LayerNorm
    from runtime.parallel_state import Group, ProcessGroups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    pg = ProcessGroups.initialize(dp=world)
    reps = 5 if quick else 9
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    gemm = {}
    for name in DTYPES:
        points = []
        for n in GEMM_SIZES[name]:
            for mm, kk, nn in LAYER_SHAPES:
                x, w = torch.randn(mm * n, kk * n, dtype=dt[name]), torch.randn(nn * n, kk * n, dtype=dt[name])
                dy = torch.randn(mm * n, nn * n, dtype=dt[name])
                runs = (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x)
                for variant, fn in zip(GEMM_VARIANTS, runs):
                    points.append((2.0 * mm * kk * nn * n ** 3, _timed(fn, reps), variant))
        gemm[name] = points
    attention = []
    for seq, batch, heads, size in ATTENTION_SHAPES:
        core = CoreAttention(heads, heads, size, causal=True, backend="sdpa")
        q, k, v = (torch.randn(seq, batch, heads * size, requires_grad=True) for _ in range(3))
        grad = torch.randn(seq, batch, heads * size)
        forward = 2.0 * batch * (seq * seq // 2) * heads * 2 * size  # QK^T and PV over the causal pairs

        def attend():
            core(q, k, v).backward(grad)

        attention.append((forward, _timed(attend, reps)))
    batched = []
    for bh, rows, size in BATCHED_SHAPES:
        q, k, v, do = (torch.randn(bh, rows, size) for _ in range(4))
        p, ds = torch.randn(bh, rows, rows), torch.randn(bh, rows, rows)

        def block():  # forward QK^T and PV; backward dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q
            q @ k.transpose(1, 2), p @ v
            do @ v.transpose(1, 2), p.transpose(1, 2) @ do, ds @ k, ds.transpose(1, 2) @ q

        batched.append((2.0 * 2 * bh * rows * rows * size, _timed(block, reps)))
    cp_blocks = []
    for seq, batch, heads, size in CP_BLOCK_SHAPES:
        for causal in (True, False):
            q, k, v = (torch.randn(seq, batch, heads * size, requires_grad=True) for _ in range(3))
            grad = torch.randn(seq, batch, heads * size)

            def blocks():  # one rank: the ring's first step over the local block
                context_parallel_attention(q, k, v, num_heads=heads, num_kv_heads=heads, head_dim=size,
                                           cp=Group.single("cp"), causal=causal).backward(grad)

            scores = batch * heads * cp_computed_pairs(seq, 1, "p2p", causal, None, False)
            cp_blocks.append((scores, size, causal, _timed(blocks, reps)))
    memory = []
    fn = torch.nn.functional
    for n in ELEMENTWISE:
        x, y, z = torch.randn(n), torch.randn(n), torch.empty(n)
        rows = x.view(-1, 256)
        memory.append((3 * 4 * n, _timed(lambda: torch.add(x, y, out=z), reps)))
        memory.append((2 * 4 * n, _timed(lambda: fn.gelu(x), reps)))
        memory.append(((2 * 4 + 1) * n, _timed(lambda: fn.dropout(x, 0.1, True), reps)))
        memory.append((2 * 4 * n, _timed(lambda: torch.softmax(rows, -1), reps)))
        memory.append((2 * 4 * n, _timed(lambda: fn.layer_norm(rows, (256,)), reps)))
    optimizer = []
    for n in OPTIMIZER_ELEMENTS:  # the runtime's step: the gradient's norm, then torch's fused AdamW
        param = torch.nn.Parameter(torch.randn(n))
        param.grad = torch.randn(n)
        adam = torch.optim.AdamW([param], lr=1e-4, fused=True)

        def step():
            torch.linalg.vector_norm(param.grad)
            adam.step()

        optimizer.append((n, _timed(step, reps)))
    collectives, sends, all_to_all, overlap = [], [], [], []
    if world > 1:
        for nbytes in ALL_REDUCE_BYTES:
            t = torch.ones(nbytes // 4)
            collectives.append((nbytes, _timed(lambda: comm.all_reduce(t, pg.dp), reps)))
        nxt, prev = (pg.dp.rank + 1) % world, (pg.dp.rank - 1) % world
        for nbytes in SEND_BYTES:
            sent, inc = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

            def exchange():
                for work in comm.send_recv(sent, nxt, inc, prev, pg.dp):
                    work.wait()

            sends.append((nbytes, _timed(exchange, reps)))
        for nbytes in ALL_TO_ALL_BYTES:
            src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
            all_to_all.append((nbytes, _timed(lambda: comm.all_to_all(dst, src, pg.dp), reps)))
        for n, nbytes in OVERLAP_POINTS:
            a, b, t = torch.randn(n, n), torch.randn(n, n), torch.ones(nbytes // 4)
            sent, inc = torch.ones(nbytes // 8), torch.empty(nbytes // 8)

            # DP's and TP's all-reduce; the pipeline's sends (gloo's, beside the compute)
            issues = (lambda: [comm.all_reduce(t, pg.dp, async_op=True)],
                      lambda: comm.send_recv(sent, nxt, inc, prev, pg.dp))
            for issue in issues:
                def beside():  # the runtime's overlap: issue, compute, then wait()
                    works = issue()
                    torch.mm(a, b)
                    for work in works:
                        work.wait()

                def alone():
                    for work in issue():
                        work.wait()

                overlap.append((_timed(lambda: torch.mm(a, b), reps), _timed(alone, reps), _timed(beside, reps)))
    overhead = []
    for k in OP_CHAINS:
        norms = [LayerNorm(16) for _ in range(k)]
        x0 = torch.randn(2, 16, requires_grad=True)

        def chain():
            x = x0
            for norm in norms:
                x = norm(x)
            x.sum().backward()

        overhead.append((k, _timed(chain, reps)))
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        pass
    if rank == 0:
        out.update(gemm=gemm, attention=attention, batched=batched, cp_blocks=cp_blocks, overlap=overlap, optimizer=optimizer, memory=memory, collectives=collectives, sends=sends, all_to_all=all_to_all,
                   overhead=overhead, rss=rss,
                   transport=pg.transport_summary(), threads=torch.get_num_threads())
    dist.barrier()
    pg.destroy() if hasattr(pg, "destroy") else None
    dist.destroy_process_group()


def _entry(rank, world, port, quick, queue):
    out = {}
    try:
        _rank(rank, world, port, quick, out)
    except BaseException as e:  # noqa: BLE001 - reported by the parent in one line
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    if rank == 0:
        queue.put((0, out))


def measure(ranks: int, quick: bool = False) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, ranks, port, quick, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    got = None
    try:
        while got is None:
            rank, value = queue.get(timeout=600)
            if isinstance(value, str):
                raise SpecError(Loc("specc calibrate"), f"rank {rank} failed: {value}")
            got = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def _link(points: list, steps: int, share: float) -> tuple:
    """(latency per step, bandwidth) of t = steps latency + share bytes / bandwidth fitted to
    (bytes, seconds) points. When the fitted slope is not positive (time that does not grow with
    the bytes: noise swamped the transfer), the bandwidth is the largest point's bytes over its
    time, the most it can cost, and the latency the smallest point's time."""
    a, b = _fit([x for x, _ in points], [t for _, t in points])
    if b <= 0:
        big, small = max(points), min(points)
        return max(small[1], 1e-7) / steps, share * big[0] / big[1]
    return max(a, 1e-7) / steps, share / b


def _cp_block_share(scores: int, head_dim: int, seconds: float, batched_rate: float, half: float,
                    bandwidth: float, op_overhead: float) -> float:
    """The CP blocks' passes' share of the memory-bound rate from one measurement: the time model's
    passes over the scores (their bytes over the bandwidth) over what is left of `seconds` after
    the GEMMs and the op's overhead as the time model charges them (specc/plan/time.py). A point
    with next to nothing left gives at most 10."""
    f_fwd, f_bwd = cp_block_flops(scores, head_dim, head_dim)
    gemms = (f_fwd + half) / batched_rate + 2 * (f_bwd / 2 + half) / batched_rate
    fwd, bwd = cp_block_pass_bytes(False, False)
    passes = (fwd + bwd) * scores / bandwidth
    return passes / max(seconds - gemms - 2 * op_overhead, passes / 10)


def profile_yaml(m: dict, ranks: int, name: str) -> str:
    """The profile of measurements `m`, every number with where it came from."""
    fits = {d: _fit([p[0] for p in pts], [p[1] for p in pts]) for d, pts in m["gemm"].items()}
    peak = {d: 1.0 / b for d, (a, b) in fits.items()}
    a32, b32 = fits["fp32"]
    half = max(0.0, a32 / b32)
    # the plan times attention as a forward GEMM and a backward of two, each (F + F_half) / (R e)
    attention = statistics.median(3 * (f + half) / (peak["fp32"] * t) for f, t in m["attention"])
    batched = statistics.median(3 * (f + half) / (peak["fp32"] * t) for f, t in m["batched"])
    bandwidth = statistics.median(nbytes / t for nbytes, t in m["memory"])
    if m["collectives"]:
        latency, link_bw = _link(m["collectives"], 2 * (ranks - 1), 2 * (ranks - 1) / ranks)
    else:
        latency, link_bw = 1e-6, bandwidth
    p2p_latency, p2p_bw = _link(m["sends"], 1, 1.0) if m["sends"] else (latency, link_bw)
    a2a_latency, a2a_bw = _link(m["all_to_all"], ranks - 1, (ranks - 1) / ranks) if m["all_to_all"] else \
        (latency, link_bw)
    # the share of the shorter of a GEMM and an all-reduce that running them together saves
    hidden = [min(1.0, max(-1.0, (g + c - both) / min(g, c))) for g, c, both in m.get("overlap", [])]
    overlap = statistics.median(hidden) if hidden else None
    # the optimizer step's bytes as the time model counts them for fp32 Adam, over its time
    opt_rate = [n * OPTIMIZER_BYTES_PER_ELEMENT / t for n, t in m.get("optimizer", [])]
    op_overhead = max(0.0, _fit([k for k, _ in m["overhead"]], [t for _, t in m["overhead"]])[1] / 2)
    cp_blocks = [_cp_block_share(scores, size, t, peak["fp32"] * batched, half, bandwidth, op_overhead)
                 for scores, size, _, t in m.get("cp_blocks", [])]
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 << 30
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    def g(d):  # the median rate of each variant over the shapes
        return "  ".join(f"{v} {statistics.median(p[0] / p[1] for p in m['gemm'][d] if p[2] == v) / 1e9:.2f}"
                         for v in GEMM_VARIANTS) + " GFLOP/s"
    lines = [
        f"# Measured by `specc calibrate --ranks {ranks}` on {socket.gethostname()}, {when}: {os.cpu_count()} cores,",
        f"# {m['threads']} thread(s) per rank; {m['transport']}",
        "# A 'device' is one rank; the peaks are the rates measured with every rank busy at once.",
        f"name: {name}",
        f"description: this host as {ranks} training ranks (specc calibrate)",
        f"devices_per_node: {ranks}",
        "device:",
        "  name: cpu-rank",
        "  peak_flops:                       # t = (F + F_half) / R fitted to a linear layer's GEMMs (forward,",
        "                                    # input and weight gradient; M = 2n tokens, n to 4n features): median rates",
    ]
    for d in DTYPES:
        lines.append(f"    {d}: {peak[d]:.4e}                  # {g(d)}")
    lines.append(f"    tf32: {peak['fp32']:.4e}                # the CPU has no TF32: fp32's")
    lines += [
        f"  memory_bytes: {ram / ranks:.4e}           # the host's RAM over the ranks",
        f"  memory_bandwidth: {bandwidth:.4e}       # median of add, GELU, dropout, softmax, layer norm (each "
        "size), bytes / time: "
        + "  ".join(f"{n / t / 1e9:.1f}GB/s" for n, t in m["memory"]),
        "intra_node:",
        "  name: " + ("shared memory" if "shared memory" in m["transport"] else "gloo (loopback)"),
        f"  bandwidth: {link_bw:.4e}              # ring all-reduce fitted by size: "
        + "  ".join(f"{n}B:{t * 1e3:.3f}ms" for n, t in m["collectives"]),
        f"  latency: {latency:.4e}                # per ring step",
        "inter_node:                         # one host: the same link",
        "  name: same host",
        f"  bandwidth: {link_bw:.4e}",
        f"  latency: {latency:.4e}",
        "point_to_point:                     # sends (runtime.comm.send_recv), each rank to the next at once",
        "  name: gloo sends",
        f"  bandwidth: {p2p_bw:.4e}              # t = latency + bytes / bandwidth fitted by size: "
        + ("  ".join(f"{n}B:{t * 1e3:.3f}ms" for n, t in m["sends"]) or "one rank: the link's"),
        f"  latency: {p2p_latency:.4e}",
        "all_to_all:                         # runtime.comm.all_to_all over the ranks (gloo's own)",
        "  name: gloo all-to-all",
        f"  bandwidth: {a2a_bw:.4e}              # (N-1) latency + (N-1)/N bytes / bandwidth fitted by size: "
        + ("  ".join(f"{n}B:{t * 1e3:.3f}ms" for n, t in m["all_to_all"]) or "one rank: the link's"),
        f"  latency: {a2a_latency:.4e}",
        "efficiency:                         # the peaks above are measured rates: nothing fitted on top",
        "  gemm: 1.0",
        f"  attention: {attention:.4f}            # fused causal attention (SDPA) forward + backward, fp32, over the "
        "GEMM rate: " + "  ".join(f"{f * 3 / t / 1e9:.2f}" for f, t in m["attention"]) + " GFLOP/s",
        f"  batched_gemm: {batched:.4f}         # per-head batched matmuls (the unfused attention's, CP's blocks), "
        "forward + backward, fp32, over the GEMM rate: " + "  ".join(f"{f * 3 / t / 1e9:.2f}" for f, t in m["batched"])
        + " GFLOP/s",
    ]
    if cp_blocks:
        lines.append(f"  cp_blocks: {statistics.median(cp_blocks):.4f}            # CP's blocks (one rank's s x s, "
                     "forward + backward, fp32), passes over the scores: the plan's bytes over the time left after "
                     "its GEMMs, over memory_bandwidth; causal/not: " + "  ".join(
                         f"{'c' if causal else 'n'}{scores}:{t * 1e3:.2f}ms={share:.2f}"
                         for (scores, _, causal, t), share in zip(m["cp_blocks"], cp_blocks)))
    lines += [
        f"  gemm_half_flops: {half:.4e}         # fp32's fixed cost per GEMM, in FLOPs",
        "  memory: 1.0",
        "  link: 1.0",
    ]
    if opt_rate:
        lines.append(f"  optimizer: {statistics.median(opt_rate) / bandwidth:.4f}            # fused AdamW step and "
                     "gradient norm over a flat fp32 buffer, the model's bytes over time: "
                     + "  ".join(f"{n}:{r / 1e9:.1f}GB/s" for (n, _), r in zip(m["optimizer"], opt_rate))
                     + ", over memory_bandwidth")
    if overlap is not None:
        lines.append(f"  overlap: {overlap:.4f}              # all-reduce, then sends, beside a GEMM: (g + c - together) "
                     "/ min(g, c), median; g/c/together: " + "  ".join(f"{g * 1e3:.2f}/{c * 1e3:.2f}/{b * 1e3:.2f}ms"
                                                              for g, c, b in m["overlap"]))
    lines += [
        f"  op_overhead: {op_overhead:.4e}       # s per op call each way: chains of k LayerNorm calls "
        "forward + backward, slope / 2; " + "  ".join(f"k={k}:{t * 1e3:.3f}ms" for k, t in m["overhead"]),
        f"framework_memory_bytes: {m['rss']:.4e}     # resident memory of a rank with torch and the runtime loaded",
    ]
    return "\n".join(lines) + "\n"


def cmd_calibrate(args) -> int:
    if args.ranks < 1:
        raise SpecError(Loc(f"--ranks {args.ranks}"), "must be at least 1")
    out = args.output
    if os.path.isdir(out):
        raise SpecError(Loc(f"-o {out}"), "is a folder", "give the profile file's path, e.g. machine.yaml")
    m = measure(args.ranks, args.quick)
    text = profile_yaml(m, args.ranks, args.name or os.path.splitext(os.path.basename(out))[0])
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:  # whole or nothing
        f.write(text)
    os.replace(tmp, out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("calibrate", help="measure this machine (GEMM, memory, collectives on N local ranks) and "
                       "write a machine profile for specc plan --machine (imports torch)")
    c.add_argument("--ranks", type=int, default=2, metavar="N", help="local ranks to measure with (default 2)")
    c.add_argument("-o", "--output", default="machine.yaml", metavar="FILE", help="profile to write (default "
                   "machine.yaml)")
    c.add_argument("--name", default=None, help="the profile's name (default: the file's)")
    c.add_argument("--quick", action="store_true", help="fewer repeats per point")
    c.set_defaults(func=cmd_calibrate)
