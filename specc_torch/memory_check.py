"""Will the run fit? The plan's memory per rank against what this node has, checked by the
launcher before any rank starts (a model too large for the host would otherwise be found by the
kernel's OOM killer, or by minutes of swapping, after torchrun started every rank).

The need counted is a lower bound: the weights, the fp32 gradient buffer, the optimizer's state
(over DP with the distributed optimizer) and the activations of the micro-batches the schedule
keeps in flight, on the pipeline rank that holds the most; nothing for torch itself, the
allocator's slack or the communication buffers. A run refused here cannot fit; a run let through
still may not."""

from __future__ import annotations

from runtime.train.config import TrainConfig
from specc.plan.render import human_bytes

MEMINFO = "/proc/meminfo"


def rank_need(totals: dict, cfg: TrainConfig, pp_rank: int | None = None, *, in_flight: bool = True) -> dict:
    """The bytes a rank needs, by what holds them (totals: the compiled plan's). At PP, pipeline
    rank `pp_rank`'s own stages, or with None the rank that needs the most; activations: the
    micro-batches the schedule keeps in flight (in_flight), or one micro-batch of each of the
    rank's stages. The distributed optimizer shards the dense weights' state over DP and the
    experts' over the expert-data-parallel ranks (DP / EP), as runtime.optim does."""
    params = totals["parameters"]
    per_param = totals["parameter_bytes"] / params if params else 0
    grad_per_param = totals["gradient_bytes"] / params if params else 0
    opt_per_param = totals["optimizer_bytes"] / params if params else 0
    par = cfg.parallel
    dense_dp, expert_dp = (par.dp, max(1, par.dp // par.ep)) if cfg.optimizer.use_distributed_optimizer else (1, 1)
    if "pipeline" in totals:
        pipe = totals["pipeline"]
        rows = [(r["parameters"], r["expert_parameters"], r["peak_activation_bytes"] if in_flight else
                 sum(st["activation_bytes"] for st in pipe["stages"] if st["rank"] == r["rank"]))
                for r in pipe["ranks"] if pp_rank is None or r["rank"] == pp_rank]
    else:
        rows = [(params, totals.get("expert_parameters", 0), totals["activation_bytes"])]
    best = None
    for n, expert, activations in rows:
        optimizer = opt_per_param * ((n - expert) / dense_dp + expert / expert_dp)
        need = {"parameters": int(n * per_param), "gradients": int(n * grad_per_param),
                "optimizer": int(optimizer), "activations": int(activations)}
        if best is None or sum(need.values()) > sum(best.values()):
            best = need
    return best


def host_available() -> int | None:
    """MemAvailable of this host in bytes (Linux), or None where it cannot be read."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_rules(totals: dict, cfg: TrainConfig, ranks_per_node: int, device: str) -> list:
    """One line when this node cannot hold `ranks_per_node` ranks of the plan; [] otherwise (or
    when the memory cannot be read: the check never refuses on a guess). device: "cuda" (each
    rank its own GPU) or "cpu" (the ranks share the host's memory)."""
    need = rank_need(totals, cfg)
    total = sum(need.values())
    parts = ", ".join(f"{name} {human_bytes(n)}" for name, n in need.items())
    if device == "cuda":
        import torch

        have = torch.cuda.get_device_properties(0).total_memory
        if total > have:
            return [f"the model does not fit: the plan needs at least {human_bytes(total)} per rank ({parts}), "
                    f"a GPU here has {human_bytes(have)} (shard it further: --tensor-model-parallel-size, "
                    f"--pipeline-model-parallel-size, --use-distributed-optimizer, --recompute-granularity)"]
        return []
    have = host_available()
    if have is None or total * ranks_per_node <= have:
        return []
    ranks = f" x {ranks_per_node} ranks on this node" if ranks_per_node > 1 else ""
    return [f"the model does not fit: the plan needs at least {human_bytes(total)} per rank ({parts}){ranks}, "
            f"this host has {human_bytes(have)} available (shrink the model, or spread it over more nodes: "
            f"--nnodes, --pipeline-model-parallel-size, --use-distributed-optimizer)"]
