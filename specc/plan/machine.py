"""Machine profiles: what the time model (specc/plan/time.py) knows of a cluster, as data.

A profile is a YAML file (the shipped ones in specc/plan/machines/, every number with its source):
devices per node; per device the dense matrix-multiply peak per dtype, memory capacity and
bandwidth; the intra-node and inter-node links (bandwidth per GPU each way, latency per step);
how much of each peak real kernels reach (`efficiency`); and a memory allowance for the framework.
Two optional keys describe a host whose framework, not its kernels, sets the pace of small ops
(what `specc calibrate` measures on a CPU): `efficiency.op_overhead`, seconds each op call costs
beyond its kernels' bytes and FLOPs (dispatch, autograd, allocation; 0 when absent), and
`point_to_point` and `all_to_all`, links that the pipeline's point-to-point sends and all-to-alls
inside a node take instead of `intra_node` (gloo carries both itself, not through the shared memory
the runtime's other CPU collectives use, the CP ring's shift included; absent: they take the
node's link). `efficiency.attention`
(optional, 1 when absent) is the rate of fused attention kernels (sdpa, flash, TE) over the GEMM
rate on the FLOPs the plan counts for them: many small per-head products with the softmax in
between reach less of the peak than one large GEMM. `efficiency.batched_gemm` (optional, 1 when
absent) is the rate of batched per-head GEMMs (torch.matmul over [batch x heads, rows, head size]:
the unfused attention's products, CP's blocks) over the GEMM rate. `efficiency.cp_blocks` (optional, 1
when absent) is the rate of the CP blocks' memory-bound passes over their scores (scaling, masking,
log-sum-exp, exponentials, the softmax gradient) over the memory-bound kernels' rate: on a CPU the
exponentials, and those of masked scores most, run below the memory's speed. `efficiency.overlap` (optional, 1 when
absent, from -1 to 1) is the share of the shorter of a collective and the compute issued beside
it that running them together saves: 1 where copy engines and NICs move the data (GPUs), less on
a CPU host, whose cores both compute and copy; below 0 when they contend, so that together they
take longer than one after the other.
`efficiency.optimizer` (optional, 1 when absent) is the optimizer step's rate on the bytes the
model counts for it over the memory-bound kernels' rate: one fused pass over a flat buffer
streams faster than a layer's mix of small kernels. `--machine` takes a shipped profile's name or a profile file's path."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import Loc, SpecError

MACHINES_DIR = os.path.join(os.path.dirname(__file__), "machines")
DTYPES = ("bf16", "fp16", "tf32", "fp32")


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per GPU, each way
    latency: float  # seconds per algorithm step


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    devices_per_node: int
    device: str
    peak_flops: dict  # dtype -> dense matmul FLOP/s
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    intra_node: Link
    inter_node: Link
    gemm_efficiency: float  # of peak, for a large GEMM
    gemm_half_flops: float  # a GEMM of this many FLOPs reaches half of that
    memory_efficiency: float  # of memory_bandwidth, for memory-bound kernels
    link_efficiency: float  # of a link's bandwidth, for a large collective
    framework_memory_bytes: float
    source: str  # the profile's name or path, as given
    op_overhead: float = 0.0  # seconds per op call, forward and backward each (0: none modelled)
    point_to_point: Link | None = None  # the link of sends inside a node, when not intra_node's
    all_to_all: Link | None = None  # the link of all-to-alls inside a node, when not intra_node's
    attention_efficiency: float = 1.0  # a fused attention kernel's rate over the GEMM rate (absent: 1)
    batched_gemm_efficiency: float = 1.0  # batched per-head GEMMs' rate over the GEMM rate (absent: 1)
    cp_blocks_efficiency: float = 1.0  # CP blocks' passes over their scores: rate over memory-bound kernels' (absent: 1)
    comm_overlap: float = 1.0  # what running a collective beside compute saves, of the shorter (absent: 1)
    optimizer_efficiency: float = 1.0  # the optimizer step's rate over the memory-bound kernels' (absent: 1)

    def peak(self, dtype: str) -> float:
        return self.peak_flops[dtype]


def known_machines() -> list:
    return sorted(f[:-5] for f in os.listdir(MACHINES_DIR) if f.endswith(".yaml"))


def load_machine(name_or_path: str) -> Machine:
    """A shipped profile by name, or a profile file; a bad one is one located line."""
    names = known_machines()
    if name_or_path in names:
        path = os.path.join(MACHINES_DIR, name_or_path + ".yaml")
    elif name_or_path.endswith((".yaml", ".yml", ".json")) or os.sep in name_or_path:
        path = name_or_path
    else:
        raise SpecError(Loc(f"--machine {name_or_path}"), "no such machine profile",
                        f"known machines: {', '.join(names)}; or give a profile file's path")
    import stat

    from ..frontend.yamlload import load_yaml, read_text

    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise SpecError(Loc(f"--machine {name_or_path}"), f"no such profile file {path}",
                        f"known machines: {', '.join(names)}") from None
    if not stat.S_ISREG(mode):  # a folder, a FIFO (reading would hang), a device
        raise SpecError(Loc(f"--machine {name_or_path}"), f"{path} is not a regular file",
                        f"known machines: {', '.join(names)}; or give a profile file's path")
    doc = load_yaml(read_text(path), path)
    return _machine(doc, path, name_or_path)


def _machine(doc, path: str, source: str) -> Machine:
    top = Loc(path, 1, 1)

    def mapping(parent, key):
        value = parent.get(key) if isinstance(parent, dict) else None
        if not isinstance(value, dict):
            where = parent.key_loc(key) if hasattr(parent, "key_loc") and key in parent else getattr(parent, "loc", top)
            raise SpecError(where, f"the profile needs a mapping '{key}'", "see specc/plan/machines/dgx-a100-80gb.yaml")
        return value

    def number(parent, key, least=0.0, most=None, integer=False):
        if key not in parent:
            raise SpecError(getattr(parent, "loc", top), f"the profile needs '{key}'",
                            "see specc/plan/machines/dgx-a100-80gb.yaml")
        value = parent[key]
        loc = parent.value_loc(key) if hasattr(parent, "value_loc") else top
        if isinstance(value, str) and not integer:  # YAML 1.1 reads 312.0e12 (no exponent sign) as text
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        if integer:
            ok = ok and isinstance(value, int)
        if not ok or value <= least or (most is not None and value > most) or value == float("inf"):
            bound = f" and at most {most}" if most is not None else ""
            raise SpecError(loc, f"'{key}' must be a {'whole ' if integer else ''}number above {least}{bound}, "
                            f"got {value!r}")
        return float(value) if not integer else int(value)

    def text(parent, key, default=""):
        value = parent.get(key, default)
        if not isinstance(value, str):
            raise SpecError(parent.value_loc(key) if hasattr(parent, "value_loc") else top,
                            f"'{key}' must be a string, got {value!r}")
        return value

    if not isinstance(doc, dict):
        raise SpecError(top, "a machine profile is a mapping", "see specc/plan/machines/dgx-a100-80gb.yaml")
    device = mapping(doc, "device")
    peaks = mapping(device, "peak_flops")
    unknown = sorted(str(k) for k in peaks if k not in DTYPES)
    if unknown:
        raise SpecError(peaks.key_loc(unknown[0]) if hasattr(peaks, "key_loc") else top,
                        f"unknown dtype '{unknown[0]}' in peak_flops", f"expected {', '.join(DTYPES)}")
    peak = {k: number(peaks, k) for k in DTYPES if k in peaks}
    for need in ("bf16", "fp16", "fp32"):
        if need not in peak:
            number(peaks, need)  # the located "needs" error
    eff = mapping(doc, "efficiency")
    links = {}
    for key in ("intra_node", "inter_node", "point_to_point", "all_to_all"):
        if key in ("point_to_point", "all_to_all") and key not in doc:
            continue
        m = mapping(doc, key)
        links[key] = Link(text(m, "name", key), number(m, "bandwidth"), number(m, "latency", least=-1e-300))
    return Machine(
        name=text(doc, "name", os.path.basename(path)), description=text(doc, "description"),
        devices_per_node=number(doc, "devices_per_node", integer=True), device=text(device, "name"),
        peak_flops=peak, memory_bytes=number(device, "memory_bytes"),
        memory_bandwidth=number(device, "memory_bandwidth"), intra_node=links["intra_node"],
        inter_node=links["inter_node"], gemm_efficiency=number(eff, "gemm", most=1.0),
        gemm_half_flops=number(eff, "gemm_half_flops", least=-1e-300),
        memory_efficiency=number(eff, "memory", most=1.0), link_efficiency=number(eff, "link", most=1.0),
        framework_memory_bytes=number(doc, "framework_memory_bytes", least=-1e-300), source=source,
        op_overhead=number(eff, "op_overhead", least=-1e-300) if "op_overhead" in eff else 0.0,
        point_to_point=links.get("point_to_point"), all_to_all=links.get("all_to_all"),
        attention_efficiency=number(eff, "attention") if "attention" in eff else 1.0,
        batched_gemm_efficiency=number(eff, "batched_gemm") if "batched_gemm" in eff else 1.0,
        cp_blocks_efficiency=number(eff, "cp_blocks") if "cp_blocks" in eff else 1.0,
        comm_overlap=number(eff, "overlap", least=-1.0 - 1e-9, most=1.0) if "overlap" in eff else 1.0,
        optimizer_efficiency=number(eff, "optimizer") if "optimizer" in eff else 1.0)
