"""The cost model of `tools/ep/ep_sim.py`: one decode step of a MoE model on the busiest rank of an
expert-parallel group, from roofline terms.

Per rank and per layer each GEMM (attention projections, the absorbed latent attention over the
KV cache, dense MLP, routed experts, shared expert, router, LM head) takes max(bytes / HBM
bandwidth, FLOPs / peak) at the achieved fractions the kernel libraries publish (`EFFICIENCY`;
`Layout.peak` drops them); a collective takes a fixed floor plus its bytes over NVLink (same node)
and RDMA (other nodes). Layouts:
- DP attention: each rank attends over its own sequences with the whole attention, dense MLP and
  LM head (data-parallel); routed experts get rows through the all-to-all exchange, FP8 dispatch
  and BF16 combine as DeepEP's low-latency mode does, bounded by the busiest rank.
- otherwise today's (docs/design.md §4): attention heads split across all EP ranks with the latent
  replicated (every rank reads every sequence's latent), replicated dense MLP and shared expert,
  vocabulary-parallel LM head with gathered logits, and an all-reduce of every row's hidden after
  attention and after the experts.
Routed-expert compute and the exchange scale with the max/mean rank load measured on a routing
trace (`tools/ep/ep_balance.py`), with EPLB's placement when `Layout.eplb` is set. Two-batch overlap
(DP attention only) runs two half batches, each reading the weights, in DeepSeek's decode schedule
(`STAGES`): one micro-batch's dispatch runs under its shared expert and the other's attention
projections, its combine under the other's core attention and output projection; what an exchange
takes beyond that compute stalls the step (`exposed_comm_ms`). The step is split by what limits it
(`ms_by_limit`: compute-bound terms, HBM-bound terms, exposed network time) and `run` adds the time
the expert-load imbalance costs against max/mean 1. With MTP a step verifies K drafts a sequence
and runs K drafter passes (one decoder layer and the LM head); tokens a step = 1 + the sum of the
running products of per-position acceptance.
Not modelled: norms, rotary, activation quantisation and other small kernels, launch gaps, the
send/receive part of an exchange occupying SMs, an exchange slower inside a full step than alone.
"""
from __future__ import annotations

import functools
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ep_balance  # noqa: E402
from ep_models import HARDWARE, Hardware, ModelShape  # noqa: E402


# Achieved fractions of peak, published by the kernel libraries on H800 SXM5 (HBM3 3.35 TB/s, BF16
# 989 / FP8 1979 dense TFLOP/s: the H100 SXM's figures) and applied to every GPU here.
# DeepGEMM README (github.com/deepseek-ai/DeepGEMM), normal FP8 GEMMs at DeepSeek-V3's own shapes: the
# memory bandwidth of its 12 decode-sized rows (M 64 and 128) and the TFLOPS of its 6 M=4096 rows; the
# median of each is the typical achieved figure (the best rows would be 2668 GB/s and 1358 TFLOPS).
DEEPGEMM_SMALL_M_GB_S = (1688, 2455, 2143, 2668, 2320, 2470, 1509, 2448, 2103, 2604, 2221, 2277)
DEEPGEMM_LARGE_M_TFLOPS = (1058, 990, 590, 1358, 1304, 1025)
EFFICIENCY = dict(
    gemm_hbm=statistics.median(DEEPGEMM_SMALL_M_GB_S) / 3350,
    gemm_flops=statistics.median(DEEPGEMM_LARGE_M_TFLOPS) / 1979,
    # FlashMLA README (github.com/deepseek-ai/FlashMLA), dense MLA decode: 3000 GB/s memory-bound,
    # 660 TFLOPS compute-bound (BF16).
    attn_hbm=3000 / 3350, attn_flops=660 / 989,
    # DeepEP legacy README (github.com/deepseek-ai/DeepEP docs/legacy.md), normal intranode kernels on
    # H800's NVLink (~160 GB/s a direction per their note): 153-158 GB/s.
    nvlink=155 / 160,
)
# DeepGEMM README, masked grouped FP8 GEMM (the decode MoE layout), TFLOPS by rows per expert: the
# mean of its two shapes (N 4096 K 7168; N 7168 K 2048) at 1024, 512 and 256 rows a group.
GROUPED_TFLOPS = ((256, (932 + 815) / 2), (512, (1040 + 916) / 2), (1024, (1233 + 925) / 2))
# DeepEP legacy README, low-latency kernels, EP 64 on H800 + CX7 400 Gb/s, 128 tokens, hidden 7168,
# top-8, FP8 dispatch / BF16 combine: dispatch 173 us, combine 314 us. Their fixed cost is what the
# bytes at line rate (56 of 64 ranks off the node) leave: the per-collective floor used everywhere.
_DEEPEP_EP, _DEEPEP_TOKENS, _DEEPEP_US = 64, 128, (173.0, 314.0)
DISPATCH_BYTES_PER_VALUE = 1 + 4 / 128      # FP8 value + one float32 scale a 128-block
COMBINE_BYTES_PER_VALUE = 2                 # BF16


def _deepep_floor_s() -> float:
    remote = 1 - 8 / _DEEPEP_EP
    line = HARDWARE["h100"].rdma_bytes_s
    sent = [_DEEPEP_TOKENS * 8 * 7168 * b * remote / line for b in (DISPATCH_BYTES_PER_VALUE, COMBINE_BYTES_PER_VALUE)]
    return sum(us * 1e-6 - s for us, s in zip(_DEEPEP_US, sent)) / 2


COLLECTIVE_FLOOR_S = _deepep_floor_s()

# The whole of that table (same README, "Low-latency kernels with pure RDMA"): EP size -> (dispatch us,
# combine us) at 128 tokens a rank. Only the EP 64 row sets the floor above; the others check the
# exchange model (tests/tools/test_ep_sim.py).
DEEPEP_LOW_LATENCY_US = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369),
                         256: (194, 360)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """One deployment: `ep` GPUs in one EP group, `batch` sequences per GPU at `context` tokens."""
    ep: int
    batch: int
    context: int
    dp_attention: bool = False
    eplb: int | None = None          # redundant experts placed by EPLB; None: contiguous, no EPLB
    overlap: bool = False
    mtp: int = 0
    accept: tuple[float, ...] = ()   # per-position conditional acceptance, len == mtp
    kv_bytes: int = 2
    gpus_per_node: int = 8
    peak: bool = False               # no published efficiency fractions: the bare roofline

    def __post_init__(self) -> None:
        if self.ep < 1 or self.batch < 1 or self.context < 1:
            raise ValueError(f"ep, batch and context must be at least 1 (got {self.ep}, {self.batch}, {self.context})")
        if self.mtp < 0 or len(self.accept) != self.mtp or any(not 0 <= a <= 1 for a in self.accept):
            raise ValueError(f"--mtp {self.mtp} needs {self.mtp} acceptance values in [0, 1], got {list(self.accept)}")
        if self.eplb is not None and self.eplb < 0:
            raise ValueError(f"--eplb {self.eplb}: the redundant experts cannot be negative")

    @property
    def tokens_per_seq_step(self) -> float:
        out, run = 1.0, 1.0
        for a in self.accept:
            run *= a
            out += run
        return out


@dataclass(frozen=True, slots=True)
class Cost:
    """One term of a step on the busiest rank: its time, what bounds it, and where it sits in
    DeepSeek's two-micro-batch decode schedule (`STAGES`)."""
    name: str
    seconds: float
    bound: str          # weights, kv, compute, comm, latency
    stage: str = ""


# DeepSeek's decode schedule with two micro-batches (github.com/deepseek-ai/profile-data README and
# assets/decode.jpg; SGLang's `_compute_moe_deepseek_blog_decode` in python/sglang/srt/operations_strategy.py
# runs the same order): per MoE layer one micro-batch's DISPATCH runs under its own SHARED expert and
# the other's ATTN-0 (MLA down/up projections, before core attention), its COMBINE under the other's
# ATTN-1 (core attention, output projection, routing gate); the routed experts (MLP) run between its
# own dispatch and combine and hide nothing. An exchange longer than the compute it runs under stalls
# the stream for the difference.
STAGES = ("attn0", "attn1", "shared", "experts", "dispatch", "combine")


def check(model: ModelShape, layout: Layout) -> None:
    """One-line refusal of a layout the model cannot take."""
    slots = model.num_experts + (layout.eplb or 0)
    if layout.dp_attention and slots % layout.ep:
        raise ValueError(f"EP {layout.ep} does not divide {model.name}'s {slots} expert slots ({model.num_experts} "
                         f"experts + {layout.eplb or 0} redundant); DeepEP's low-latency mode needs equal experts "
                         f"per rank: pick --eplb R with ({model.num_experts} + R) % {layout.ep} == 0")
    if layout.eplb is not None and slots % layout.ep:
        raise ValueError(f"--eplb {layout.eplb}: {slots} expert slots do not split evenly over EP {layout.ep}")
    if layout.overlap and not layout.dp_attention:
        raise ValueError("--overlap models DeepSeek's two-micro-batch schedule of the all-to-all exchange: "
                         "it needs --dp-attention (today's all-reduce layout has no such schedule)")
    if layout.ep > layout.gpus_per_node and layout.ep % layout.gpus_per_node:
        raise ValueError(f"EP {layout.ep} is not a whole number of {layout.gpus_per_node}-GPU nodes")


def _grouped_flops_fraction(rows_per_expert: float) -> float:
    """DeepGEMM's masked grouped GEMM TFLOPS at this many rows an expert (log-linear between its rows)."""
    xs = [math.log2(m) for m, _ in GROUPED_TFLOPS]
    x = min(max(math.log2(max(rows_per_expert, 1.0)), xs[0]), xs[-1])
    for (x0, (_, y0)), (x1, (_, y1)) in zip(zip(xs, GROUPED_TFLOPS), zip(xs[1:], GROUPED_TFLOPS[1:])):
        if x <= x1:
            return (y0 + (y1 - y0) * (x - x0) / (x1 - x0)) / 1979
    return GROUPED_TFLOPS[-1][1] / 1979


def _roof(name: str, hw: Hardware, layout: Layout, *, weight_bytes: float = 0.0, kv_bytes: float = 0.0,
          act_bytes: float = 0.0, flops: float = 0.0, fp8: bool = True, attention: bool = False,
          flops_fraction: float | None = None, stage: str = "") -> Cost:
    e = {k: 1.0 for k in EFFICIENCY} if layout.peak else EFFICIENCY
    hbm = hw.hbm_bytes_s * (e["attn_hbm"] if attention else e["gemm_hbm"])
    frac = 1.0 if layout.peak else (flops_fraction or (e["attn_flops"] if attention else e["gemm_flops"]))
    peak = (hw.fp8_flops if fp8 else hw.bf16_flops) * frac
    t_mem, t_math = (weight_bytes + kv_bytes + act_bytes) / hbm, flops / peak
    bound = "compute" if t_math >= t_mem else ("kv" if kv_bytes > weight_bytes else "weights")
    return Cost(name, max(t_mem, t_math), bound, stage)


def _collective(name: str, hw: Hardware, layout: Layout, *, nvlink_bytes: float, rdma_bytes: float,
                stage: str = "") -> list[Cost]:
    """Bytes over NVLink and RDMA (whichever takes longer) plus the per-collective floor; none at EP 1."""
    if layout.ep == 1:
        return []
    nvl = hw.nvlink_bytes_s * (1.0 if layout.peak else EFFICIENCY["nvlink"])
    return [Cost(name, max(nvlink_bytes / nvl, rdma_bytes / hw.rdma_bytes_s), "comm", stage),
            Cost(name + " floor", COLLECTIVE_FLOOR_S, "latency", stage)]


def exchange_us(hw: Hardware, layout: Layout, rows: float, hidden: int, top_k: int, load: float = 1.0) -> dict:
    """The modelled dispatch and combine of `rows` rows a rank, in us (floor included)."""
    out = {}
    for phase in ("dispatch", "combine"):
        terms = [c for c in _exchange(hw, layout, rows, hidden, top_k, load) if c.stage == phase]
        out[phase] = sum(c.seconds for c in terms) * 1e6
    return out


def _exchange(hw: Hardware, layout: Layout, rows: float, hidden: int, top_k: int, load: float) -> list[Cost]:
    """DeepEP's low-latency dispatch (FP8) and combine (BF16) of `rows` rows a rank: the busiest rank
    receives (dispatch) and sends (combine) `load` times the mean; NVLink inside the node, RDMA across."""
    remote = 1 - min(layout.gpus_per_node, layout.ep) / layout.ep
    out = []
    for phase, sent in alltoall_bytes(rows, hidden, top_k).items():
        out += _collective(f"a2a {phase}", hw, layout, nvlink_bytes=sent * load * (1 - remote),
                           rdma_bytes=sent * load * remote, stage=phase)
    return out


def alltoall_bytes(rows: float, hidden: int, top_k: int) -> dict[str, float]:
    """Bytes one rank sends for `rows` rows: FP8 dispatch (with a float32 scale each 128 values) and
    BF16 combine, one copy per chosen expert (DeepEP's low-latency mode; counts the rank's own)."""
    return {"dispatch": rows * top_k * hidden * DISPATCH_BYTES_PER_VALUE,
            "combine": rows * top_k * hidden * COMBINE_BYTES_PER_VALUE}


def allreduce_bytes(rows: float, hidden: int, ranks: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `rows` BF16 hidden rows over `ranks` ranks."""
    return 2 * (ranks - 1) / ranks * rows * hidden * 2


def _allreduce(name: str, hw: Hardware, layout: Layout, rows: float, hidden: int) -> list[Cost]:
    """Hierarchical all-reduce: ring inside the node over NVLink, ring over the nodes' shards over RDMA."""
    g = min(layout.gpus_per_node, layout.ep)
    nodes = max(1, layout.ep // layout.gpus_per_node)
    node_shard = rows * hidden * 2 / g
    return _collective(name, hw, layout, nvlink_bytes=allreduce_bytes(rows, hidden, g),
                       rdma_bytes=2 * (nodes - 1) / nodes * node_shard if nodes > 1 else 0.0)


def _attention(model: ModelShape, hw: Hardware, layout: Layout, rows: float, seqs: float, kind: str) -> list[Cost]:
    """The layer's token mixer on one rank: the projections before the core (stage attn0), then the
    read of the cache (or state) and the output projections (attn1)."""
    split = 1 if layout.dp_attention else layout.ep
    a, ctx = model.attention, layout.context

    def proj(name: str, params: float, stage: str) -> Cost:
        return _roof(name, hw, layout, weight_bytes=params * model.weight_bytes, flops=2 * rows * params, stage=stage)

    if kind == "mla":
        heads = a.heads / split
        # q_a, kv_a (replicated), q_b and the absorbed key up-projection; then value up- and output projection
        down_up = model.hidden * (a.q_lora + a.kv_lora + a.qk_rope) + heads * (a.q_lora * (a.qk_nope + a.qk_rope)
                                                                                + a.kv_lora * a.qk_nope)
        out_proj = heads * (a.kv_lora * a.v_head + a.v_head * model.hidden)
        attended = min(ctx, a.index_topk) if a.index_topk else ctx
        kv = seqs * attended * (a.kv_lora + a.qk_rope) * layout.kv_bytes
        flops = rows * attended * 2 * heads * (2 * a.kv_lora + a.qk_rope)
        out = [proj("attn down/up proj", down_up, "attn0"),
               _roof("attn core", hw, layout, kv_bytes=kv, flops=flops, fp8=False, attention=True, stage="attn1"),
               proj("attn out proj", out_proj, "attn1")]
        if a.index_topk:   # DeepSeek sparse attention's indexer: FP8 keys of every cached token
            idx_params = a.q_lora * a.index_heads * a.index_dim + model.hidden * (a.index_dim + a.index_heads)
            out.append(_roof("indexer", hw, layout, weight_bytes=idx_params * model.weight_bytes,
                             kv_bytes=seqs * ctx * (a.index_dim + 4),
                             flops=2 * rows * (idx_params + ctx * a.index_heads * a.index_dim), stage="attn0"))
        return out
    if kind == "gqa":
        heads, kv_heads = a.heads / split, max(1.0, a.kv_heads / split)
        kv = seqs * ctx * 2 * kv_heads * a.head_dim * layout.kv_bytes
        return [proj("attn qkv proj", model.hidden * a.head_dim * (heads * (2 if a.gated else 1) + 2 * kv_heads),
                     "attn0"),
                _roof("attn core", hw, layout, kv_bytes=kv, flops=rows * ctx * 4 * heads * a.head_dim, fp8=False,
                      attention=True, stage="attn1"),
                proj("attn out proj", model.hidden * a.head_dim * heads, "attn1")]
    # Gated DeltaNet: a fixed-size recurrent state per sequence, read and written every step.
    v_heads, k_heads = a.linear_v_heads / split, a.linear_k_heads / split
    state = seqs * v_heads * a.linear_k_dim * a.linear_v_dim * 2 * 2
    return [proj("linear in proj", model.hidden * (2 * k_heads * a.linear_k_dim + 2 * v_heads * a.linear_v_dim
                                                   + 2 * v_heads), "attn0"),
            _roof("linear state", hw, layout, kv_bytes=state,
                  flops=rows * 6 * v_heads * a.linear_k_dim * a.linear_v_dim, fp8=False, attention=True, stage="attn1"),
            proj("linear out proj", v_heads * a.linear_v_dim * model.hidden, "attn1")]


def _experts(model: ModelShape, hw: Hardware, layout: Layout, rows: float, load: float) -> list[Cost]:
    """Routed and shared experts on the busiest rank and, with DP attention, its exchange."""
    e_params = 3 * model.hidden * model.moe_intermediate
    global_rows = rows * layout.ep if layout.dp_attention else rows
    slots = model.num_experts + (layout.eplb or 0)
    local = slots / layout.ep
    mean_rows = global_rows * model.top_k / layout.ep
    per_slot = global_rows * model.top_k / slots
    touched = local * -math.expm1(-per_slot)                # expected experts with at least one row
    busiest = mean_rows * load
    out = [_roof("routed experts", hw, layout, weight_bytes=touched * e_params * model.weight_bytes,
                 act_bytes=busiest * model.hidden * 3, flops=2 * busiest * e_params,
                 flops_fraction=_grouped_flops_fraction(busiest / local), stage="experts")]
    if model.shared_intermediate:
        s_params = 3 * model.hidden * model.shared_intermediate
        out.append(_roof("shared expert", hw, layout, weight_bytes=s_params * model.weight_bytes,
                         flops=2 * rows * s_params, stage="shared"))
    router = model.hidden * model.num_experts
    out.append(_roof("router", hw, layout, weight_bytes=router * 2, flops=2 * rows * router, fp8=False,
                     stage="attn1"))
    if not layout.dp_attention:
        return out + _allreduce("expert all-reduce", hw, layout, rows, model.hidden)
    return out + _exchange(hw, layout, rows, model.hidden, model.top_k, load)


def _layer(model: ModelShape, hw: Hardware, layout: Layout, rows: float, seqs: float, kind: str, moe: bool,
           load: float) -> list[Cost]:
    out = _attention(model, hw, layout, rows, seqs, kind)
    if not layout.dp_attention:
        out += _allreduce("attn all-reduce", hw, layout, rows, model.hidden)
    if moe:
        return out + _experts(model, hw, layout, rows, load)
    d_params = 3 * model.hidden * model.dense_intermediate
    return out + [_roof("dense mlp", hw, layout, weight_bytes=d_params * model.weight_bytes, flops=2 * rows * d_params)]


def _lm_head(model: ModelShape, hw: Hardware, layout: Layout, rows: float) -> list[Cost]:
    if layout.dp_attention:
        params = model.vocab * model.hidden
        return [_roof("lm head", hw, layout, weight_bytes=params * 2, flops=2 * rows * params, fp8=False)]
    params = model.vocab * model.hidden / layout.ep
    out = [_roof("lm head", hw, layout, weight_bytes=params * 2, flops=2 * rows * params, fp8=False)]
    if layout.ep > 1:    # rank 0 gathers every rank's float32 logits slice
        gathered = (layout.ep - 1) / layout.ep * rows * model.vocab * 4
        nodes = max(1, layout.ep // layout.gpus_per_node)
        out += _collective("logits gather", hw, layout, nvlink_bytes=gathered / nodes,
                           rdma_bytes=gathered * (nodes - 1) / nodes)
    return out


def _pass(model: ModelShape, hw: Hardware, layout: Layout, rows: float, seqs: float, load: float,
          layers: tuple[tuple[str, bool], ...]) -> list[list[Cost]]:
    """One forward: the terms of each decoder layer, then the LM head's as one more group."""
    out = [_layer(model, hw, layout, rows, seqs, kind, moe, load) for kind, moe in layers]
    return out + [_lm_head(model, hw, layout, rows)]


def _is_comm(c: Cost) -> bool:
    return c.bound in ("comm", "latency")


def _exposed_comm(group: list[Cost], overlap: bool) -> float:
    """The communication of a layer (both micro-batches) that the stream waits for: all of it
    without overlap; with it, what each exchange phase takes beyond the compute `STAGES` puts under it."""
    comm = {st: sum(c.seconds for c in group if _is_comm(c) and c.stage == st) for st in ("dispatch", "combine", "")}
    if not overlap:
        return sum(comm.values())
    work = {st: sum(c.seconds for c in group if not _is_comm(c) and c.stage == st) for st in STAGES}
    return (max(0.0, comm["dispatch"] - work["shared"] - work["attn0"]) + max(0.0, comm["combine"] - work["attn1"])
            + comm[""])


@functools.lru_cache(maxsize=4096)
def expert_load(model: ModelShape, layout: Layout, trace_path: str) -> float:
    """max/mean rank load of the routed experts for this layout (1.0 at EP 1), for the rows one
    exchange carries (a micro-batch's with two-batch overlap)."""
    if layout.ep == 1:
        return 1.0
    rows = layout.batch * (1 + layout.mtp) * layout.ep / (2 if layout.overlap else 1)
    return ep_balance.layout_imbalance(ep_balance.load_trace(Path(trace_path)), num_experts=model.num_experts,
                                       ep=layout.ep, eplb_redundant=layout.eplb, gpus_per_node=layout.gpus_per_node,
                                       num_groups=model.num_groups, rows_per_step=rows, top_k=model.top_k)


def simulate(model: ModelShape, hw: Hardware, layout: Layout, trace: Path = ep_balance.DEFAULT_TRACE,
             load: float | None = None) -> dict:
    """The step on the busiest rank: its terms, time, tokens/s per GPU and per node, and the
    dominant term (the bound whose terms add up to the most time before any overlap)."""
    check(model, layout)
    if load is not None and load < 1:
        raise ValueError(f"--load {load}: a max/mean rank load is at least 1")
    load = expert_load(model, layout, str(trace)) if load is None else load
    seqs = layout.batch if layout.dp_attention else layout.batch * layout.ep
    rows = seqs * (1 + layout.mtp)
    parts = 2 if layout.overlap else 1
    groups = _pass(model, hw, layout, rows / parts, seqs / parts, load, model.layers)
    for _ in range(layout.mtp):   # one MTP decoder layer (with eh_proj) and the LM head, one row a sequence
        eh = 2 * model.hidden * model.hidden
        drafter = _pass(model, hw, layout, seqs / parts, seqs / parts, load, (model.layers[-1],))
        drafter[0].append(_roof("mtp eh_proj", hw, layout, weight_bytes=eh * model.weight_bytes,
                                flops=2 * seqs / parts * eh))
        groups += drafter
    groups = [[Cost(c.name, c.seconds * parts, c.bound, c.stage) for c in g] for g in groups]   # both micro-batches
    terms = [c for g in groups for c in g]
    compute = sum(c.seconds for c in terms if not _is_comm(c))
    comm = sum(c.seconds for c in terms if _is_comm(c))
    exposed = sum(_exposed_comm(g, layout.overlap) for g in groups)
    step = compute + exposed
    by_bound: dict[str, float] = {}
    for c in terms:
        by_bound[c.bound] = by_bound.get(c.bound, 0.0) + c.seconds
    tokens = seqs * layout.tokens_per_seq_step / (1 if layout.dp_attention else layout.ep)   # per GPU
    return {"model": model.name, "hw": hw.name, "ep": layout.ep, "batch": layout.batch, "context": layout.context,
            "dp_attention": layout.dp_attention, "eplb": layout.eplb, "overlap": layout.overlap, "mtp": layout.mtp,
            "accept": list(layout.accept), "peak": layout.peak,
            "tokens_per_seq_step": round(layout.tokens_per_seq_step, 4),
            "load_max_over_mean": round(load, 4), "step_ms": step * 1e3, "compute_ms": compute * 1e3,
            "comm_ms": comm * 1e3, "exposed_comm_ms": exposed * 1e3, "tok_s_per_gpu": tokens / step,
            "tok_s_per_node": tokens / step * min(layout.gpus_per_node, layout.ep),
            "ms_by_bound": {k: round(v * 1e3, 3) for k, v in by_bound.items()},
            "dominant": max(by_bound, key=by_bound.get), **_limits(terms, exposed)}


def _limits(terms: list[Cost], exposed: float) -> dict:
    """The step split by what limits it: compute-bound terms, HBM-bound ones (weights, cache) and the
    communication the stream waits for (network), in ms, and the largest of the three."""
    ms = {"compute": sum(c.seconds for c in terms if c.bound == "compute") * 1e3,
          "hbm": sum(c.seconds for c in terms if c.bound in ("weights", "kv")) * 1e3, "network": exposed * 1e3}
    return {"ms_by_limit": {k: round(v, 3) for k, v in ms.items()}, "limit": max(ms, key=ms.get)}


def memory_per_rank(model: ModelShape, layout: Layout) -> dict[str, float]:
    """Bytes one rank holds: weights (its experts, the attention it runs, replicated parts) and the
    cache of the sequences it serves (every sequence's latent in today's layout: it is replicated)."""
    split = 1 if layout.dp_attention else layout.ep
    a = model.attention
    slots = model.num_experts + (layout.eplb or 0)
    weights = 0.0
    cache_per_seq = 0.0
    for kind, moe in model.layers:
        if kind == "mla":
            per_head = a.q_lora * (a.qk_nope + a.qk_rope) + a.kv_lora * (a.qk_nope + a.v_head) + a.v_head * model.hidden
            weights += model.hidden * (a.q_lora + a.kv_lora + a.qk_rope) + a.heads / split * per_head
            cache_per_seq += layout.context * (a.kv_lora + a.qk_rope + (a.index_dim if a.index_topk else 0)) \
                * layout.kv_bytes
        elif kind == "gqa":
            kv_heads = max(1.0, a.kv_heads / split)
            weights += model.hidden * a.head_dim * (a.heads / split * (3 if a.gated else 2) + 2 * kv_heads)
            cache_per_seq += layout.context * 2 * kv_heads * a.head_dim * layout.kv_bytes
        else:
            v_heads = a.linear_v_heads / split
            weights += model.hidden * (2 * a.linear_k_heads / split * a.linear_k_dim + 3 * v_heads * a.linear_v_dim)
            cache_per_seq += v_heads * a.linear_k_dim * a.linear_v_dim * 2
        if moe:
            weights += 3 * model.hidden * (slots / layout.ep * model.moe_intermediate + model.shared_intermediate)
        else:
            weights += 3 * model.hidden * model.dense_intermediate
    weights *= model.weight_bytes
    weights += model.vocab * model.hidden * 2 * (1 + 1 / split)       # embedding (whole) + LM head (its slice)
    seqs = layout.batch if layout.dp_attention else layout.batch * layout.ep
    return {"weights_gb": weights / 1e9, "cache_gb": seqs * cache_per_seq / 1e9}


def run(model: ModelShape, hw: Hardware, layout: Layout, trace: Path = ep_balance.DEFAULT_TRACE,
        load: float | None = None) -> dict:
    """`simulate` plus the step time the expert-load imbalance adds (against the same layout at
    max/mean 1), what the rank must hold and whether it fits the GPU's memory."""
    out = simulate(model, hw, layout, trace, load)
    out["imbalance_ms"] = out["step_ms"] - simulate(model, hw, layout, trace, 1.0)["step_ms"]
    mem = memory_per_rank(model, layout)
    out.update({k: round(v, 2) for k, v in mem.items()})
    out["fits"] = mem["weights_gb"] + mem["cache_gb"] <= hw.hbm_bytes / 1e9
    return out
