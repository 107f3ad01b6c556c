"""Predicts the decode step time and output tokens/s per node of a MoE model served with expert
parallelism, from roofline terms, for a model, a GPU and a layout.

    python tools/ep_sim.py --model deepseek-v3 --hw h100 --ep 72 --dp-attention --eplb 32 --overlap \\
        --mtp 1 --accept 0.85 [--batch 256] [--context 2000] [--sweep 8,16,...] [--json-out F] [--plot F]
    python tools/ep_sim.py --reproduce-sglang       # SGLang's 96-H100 decode figure and today's layout on 8 GPUs

Per rank and per layer each GEMM (attention projections, the absorbed latent attention over the
KV cache, dense MLP, routed experts, shared expert, LM head) takes max(bytes / HBM bandwidth,
FLOPs / peak) with the achieved fractions the kernel libraries publish (`EFFICIENCY`; `--peak`
drops them); collectives take a fixed cost plus bytes over NVLink (same node) and RDMA (other
nodes). Layouts:
- `--dp-attention`: each rank attends over its own sequences with the whole attention, dense MLP
  and LM head (data-parallel); routed experts get rows through the all-to-all exchange, FP8
  dispatch and BF16 combine as DeepEP's low-latency mode does, bounded by the busiest rank.
- otherwise today's (docs/design.md §4): attention heads split across all EP ranks with the
  latent replicated (every rank reads every sequence's latent), replicated dense MLP and shared
  expert, vocabulary-parallel LM head with gathered logits, and one all-reduce of every row's
  hidden after attention and after the experts.
Routed-expert compute and the exchange scale with the max/mean rank load measured on a routing
trace (`tools/ep_balance.py`), with EPLB's placement when `--eplb R`. `--overlap` (two-batch
overlap) runs two half batches, each reading the weights, and hides min(compute, communication).
With `--mtp K` a step verifies K drafts a sequence and runs K drafter passes (one decoder layer
and the LM head); tokens a step = 1 + sum over positions of the product of per-position acceptance.
Not modelled: norms, rotary, activation quantisation and other elementwise kernels, and launch gaps.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ep_balance  # noqa: E402
from ep_models import HARDWARE, MODELS, Hardware, ModelShape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

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
    """One term of a step on the busiest rank: its time and what bounds it."""
    name: str
    seconds: float
    bound: str          # weights, kv, compute, comm, latency


def check(model: ModelShape, layout: Layout) -> None:
    """One-line refusal of a layout the model cannot take."""
    slots = model.num_experts + (layout.eplb or 0)
    if layout.dp_attention and slots % layout.ep:
        raise ValueError(f"EP {layout.ep} does not divide {model.name}'s {slots} expert slots ({model.num_experts} "
                         f"experts + {layout.eplb or 0} redundant); DeepEP's low-latency mode needs equal experts "
                         f"per rank: pick --eplb R with ({model.num_experts} + R) % {layout.ep} == 0")
    if layout.eplb is not None and slots % layout.ep:
        raise ValueError(f"--eplb {layout.eplb}: {slots} expert slots do not split evenly over EP {layout.ep}")
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
          flops_fraction: float | None = None) -> Cost:
    e = {k: 1.0 for k in EFFICIENCY} if layout.peak else EFFICIENCY
    hbm = hw.hbm_bytes_s * (e["attn_hbm"] if attention else e["gemm_hbm"])
    frac = 1.0 if layout.peak else (flops_fraction or (e["attn_flops"] if attention else e["gemm_flops"]))
    peak = (hw.fp8_flops if fp8 else hw.bf16_flops) * frac
    t_mem, t_math = (weight_bytes + kv_bytes + act_bytes) / hbm, flops / peak
    bound = "compute" if t_math >= t_mem else ("kv" if kv_bytes > weight_bytes else "weights")
    return Cost(name, max(t_mem, t_math), bound)


def _collective(name: str, hw: Hardware, layout: Layout, *, nvlink_bytes: float, rdma_bytes: float) -> list[Cost]:
    """Bytes over NVLink and RDMA (whichever takes longer) plus the per-collective floor; none at EP 1."""
    if layout.ep == 1:
        return []
    nvl = hw.nvlink_bytes_s * (1.0 if layout.peak else EFFICIENCY["nvlink"])
    return [Cost(name, max(nvlink_bytes / nvl, rdma_bytes / hw.rdma_bytes_s), "comm"),
            Cost(name + " floor", COLLECTIVE_FLOOR_S, "latency")]


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
    """The layer's token mixer on one rank: projections, then the read of the cache (or state)."""
    split = 1 if layout.dp_attention else layout.ep
    a, ctx = model.attention, layout.context
    if kind == "mla":
        replicated = model.hidden * (a.q_lora + a.kv_lora + a.qk_rope)                 # q_a, kv_a
        heads = a.heads / split
        per_head = a.q_lora * (a.qk_nope + a.qk_rope) + a.kv_lora * (a.qk_nope + a.v_head) + a.v_head * model.hidden
        params = replicated + heads * per_head
        attended = min(ctx, a.index_topk) if a.index_topk else ctx
        kv = seqs * attended * (a.kv_lora + a.qk_rope) * layout.kv_bytes
        flops = rows * attended * 2 * heads * (2 * a.kv_lora + a.qk_rope)
        out = [_roof("attn proj", hw, layout, weight_bytes=params * model.weight_bytes, flops=2 * rows * params),
               _roof("attn core", hw, layout, kv_bytes=kv, flops=flops, fp8=False, attention=True)]
        if a.index_topk:   # DeepSeek sparse attention's indexer: FP8 keys of every cached token
            idx_params = a.q_lora * a.index_heads * a.index_dim + model.hidden * (a.index_dim + a.index_heads)
            out.append(_roof("indexer", hw, layout, weight_bytes=idx_params * model.weight_bytes,
                             kv_bytes=seqs * ctx * (a.index_dim + 4),
                             flops=2 * rows * (idx_params + ctx * a.index_heads * a.index_dim)))
        return out
    if kind == "gqa":
        heads, kv_heads = a.heads / split, max(1.0, a.kv_heads / split)
        params = model.hidden * a.head_dim * (heads * (2 if a.gated else 1) + 2 * kv_heads + heads)
        kv = seqs * ctx * 2 * kv_heads * a.head_dim * layout.kv_bytes
        return [_roof("attn proj", hw, layout, weight_bytes=params * model.weight_bytes, flops=2 * rows * params),
                _roof("attn core", hw, layout, kv_bytes=kv, flops=rows * ctx * 4 * heads * a.head_dim, fp8=False,
                      attention=True)]
    # Gated DeltaNet: a fixed-size recurrent state per sequence, read and written every step.
    v_heads, k_heads = a.linear_v_heads / split, a.linear_k_heads / split
    params = model.hidden * (2 * k_heads * a.linear_k_dim + 2 * v_heads * a.linear_v_dim + 2 * v_heads) \
        + v_heads * a.linear_v_dim * model.hidden
    state = seqs * v_heads * a.linear_k_dim * a.linear_v_dim * 2 * 2
    return [_roof("linear proj", hw, layout, weight_bytes=params * model.weight_bytes, flops=2 * rows * params),
            _roof("linear state", hw, layout, kv_bytes=state, flops=rows * 6 * v_heads * a.linear_k_dim * a.linear_v_dim,
                  fp8=False, attention=True)]


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
                 flops_fraction=_grouped_flops_fraction(busiest / local))]
    if model.shared_intermediate:
        s_params = 3 * model.hidden * model.shared_intermediate
        out.append(_roof("shared expert", hw, layout, weight_bytes=s_params * model.weight_bytes,
                         flops=2 * rows * s_params))
    router = model.hidden * model.num_experts
    out.append(_roof("router", hw, layout, weight_bytes=router * 2, flops=2 * rows * router, fp8=False))
    if not layout.dp_attention:
        return out + _allreduce("expert all-reduce", hw, layout, rows, model.hidden)
    remote = 1 - min(layout.gpus_per_node, layout.ep) / layout.ep
    for phase, sent in alltoall_bytes(rows, model.hidden, model.top_k).items():
        busiest_bytes = sent * load                          # the busiest rank receives (dispatch) / sends (combine) most
        out += _collective(f"a2a {phase}", hw, layout, nvlink_bytes=busiest_bytes * (1 - remote),
                           rdma_bytes=busiest_bytes * remote)
    return out


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


def _group_seconds(group: list[Cost], overlap: bool) -> float:
    """A layer's time: its compute and its communication, less what two-batch overlap hides
    (min of the two: one micro-batch's exchange runs under the other's compute, inside the layer,
    since the next layer needs this one's output)."""
    compute = sum(c.seconds for c in group if not _is_comm(c))
    comm = sum(c.seconds for c in group if _is_comm(c))
    return compute + comm - (min(compute, comm) if overlap else 0.0)


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
    groups = [[Cost(c.name, c.seconds * parts, c.bound) for c in g] for g in groups]   # both micro-batches
    terms = [c for g in groups for c in g]
    compute = sum(c.seconds for c in terms if not _is_comm(c))
    comm = sum(c.seconds for c in terms if _is_comm(c))
    step = sum(_group_seconds(g, layout.overlap) for g in groups)
    by_bound: dict[str, float] = {}
    for c in terms:
        by_bound[c.bound] = by_bound.get(c.bound, 0.0) + c.seconds
    tokens = seqs * layout.tokens_per_seq_step / (1 if layout.dp_attention else layout.ep)   # per GPU
    return {"model": model.name, "hw": hw.name, "ep": layout.ep, "batch": layout.batch, "context": layout.context,
            "dp_attention": layout.dp_attention, "eplb": layout.eplb, "overlap": layout.overlap, "mtp": layout.mtp,
            "accept": list(layout.accept), "peak": layout.peak, "tokens_per_seq_step": round(layout.tokens_per_seq_step, 4),
            "load_max_over_mean": round(load, 4), "step_ms": step * 1e3, "compute_ms": compute * 1e3,
            "comm_ms": comm * 1e3, "tok_s_per_gpu": tokens / step, "tok_s_per_node": tokens / step * min(
                layout.gpus_per_node, layout.ep), "ms_by_bound": {k: round(v * 1e3, 3) for k, v in by_bound.items()},
            "dominant": max(by_bound, key=by_bound.get)}


SGLANG_96_H100 = dict(
    # LMSYS blog, May 5 2025, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism
    # on 96 H100 GPUs" (lmsys.org/blog/2025-05-05-large-scale-ep), decode table: 9 nodes (EP72, DP
    # attention, DeepEP low-latency, two-batch overlap), batch 256 a device, KV length 2,000, no MTP:
    # 22,282 output tokens/s per node. Redundant experts 32 and --cuda-graph-bs 256 from the reproduction
    # command the blog links (github.com/sgl-project/sglang/issues/6017).
    layout=Layout(ep=72, batch=256, context=2000, dp_attention=True, eplb=32, overlap=True),
    tok_s_per_node=22282.0,
)


DEEPSEEK_PROFILE = dict(
    # The same blog's decode table, "DeepSeek Profile" column, from github.com/deepseek-ai/profile-data
    # (decode: EP128, batch 128 requests a GPU, 4K prompts, two micro-batches; "we simulate an
    # absolutely balanced MoE routing strategy for profiling"): 18,598 tokens/s per node. Whether
    # that counts MTP's extra tokens is not stated, so both are predicted.
    layout=Layout(ep=128, batch=128, context=4096, dp_attention=True, eplb=0, overlap=True),
    load=1.0, tok_s_per_node=18598.0,
)


def reproduce_sglang(trace: Path = ep_balance.DEFAULT_TRACE) -> dict:
    """SGLang's layout, and today's tensor-parallel attention on one 8-GPU node of H100 (where
    DeepSeek-V3's FP8 weights alone exceed 80 GB a GPU: `fits` is false) and of H200."""
    model = MODELS["deepseek-v3"]
    theirs = run(model, HARDWARE["h100"], SGLANG_96_H100["layout"], trace)
    today = [run(model, HARDWARE[hw], Layout(ep=8, batch=b, context=2000), trace)
             for hw in ("h100", "h200") for b in (4, 8, 16, 32, 64)]
    profile = [run(model, HARDWARE["h100"], replace(DEEPSEEK_PROFILE["layout"], mtp=k, accept=(0.85,) * k), trace,
                   DEEPSEEK_PROFILE["load"]) for k in (0, 1)]
    return {"sglang_layout": theirs, "published_tok_s_per_node": SGLANG_96_H100["tok_s_per_node"],
            "ratio": theirs["tok_s_per_node"] / SGLANG_96_H100["tok_s_per_node"], "today_tp_attention_ep8": today,
            "deepseek_profile": profile, "deepseek_profile_tok_s_per_node": DEEPSEEK_PROFILE["tok_s_per_node"],
            "deepseek_profile_ratios": [r["tok_s_per_node"] / DEEPSEEK_PROFILE["tok_s_per_node"] for r in profile]}


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
    """`simulate` plus what the rank must hold and whether it fits the GPU's memory."""
    out = simulate(model, hw, layout, trace, load)
    mem = memory_per_rank(model, layout)
    out.update({k: round(v, 2) for k, v in mem.items()})
    out["fits"] = mem["weights_gb"] + mem["cache_gb"] <= hw.hbm_bytes / 1e9
    return out


COLUMNS = ("layout", "model", "hw", "ep", "batch", "context", "dp_attention", "eplb", "overlap", "mtp", "load_max_over_mean",
           "step_ms", "compute_ms", "comm_ms", "tok_s_per_node", "dominant", "weights_gb", "cache_gb", "fits")


def print_table(rows: list[dict]) -> None:
    def fmt(v: object) -> str:
        return f"{v:.1f}" if isinstance(v, float) else "-" if v is None else str(v)
    cells = [[fmt(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def plot(series: dict[str, list[dict]], path: Path, title: str,
         published: tuple[str, float, float] | None = None) -> None:
    """Tokens/s per node against batch per rank, one line per layout, and a published measurement
    (label, batch, tokens/s per node) as a star."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rows in series.items():
        ax.plot([r["batch"] for r in rows], [r["tok_s_per_node"] for r in rows], marker="o", label=label)
        over = [r for r in rows if not r["fits"]]
        if over:
            ax.scatter([r["batch"] for r in over], [r["tok_s_per_node"] for r in over], marker="x", color="black",
                       s=60, zorder=3)
    if published:
        ax.scatter([published[1]], [published[2]], marker="*", s=220, color="gold", edgecolor="black", zorder=4,
                   label=published[0])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences per GPU (black x: weights + cache exceed the GPU's memory)")
    ax.set_ylabel("output tokens/s per node (predicted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The embedded model's measured MTP acceptance (bench/records/depth_by_width_f32_ae5390e.json: one draft,
# p1 0.8201) and DeepSeek's published second-token acceptance, 85-90% (DeepSeek-V3 technical report,
# arXiv 2412.19437, section 5.4.3).
ACCEPT_EMBEDDED, ACCEPT_DEEPSEEK = 0.8201, (0.85, 0.90)


def grid_layouts(ep: int) -> dict[str, Layout]:
    """The layouts measured at each EP size: today's, DP attention alone, with EPLB (32 redundant
    experts), with two-batch overlap, and with one MTP draft at three acceptances."""
    dp = Layout(ep=ep, batch=128, context=2000, dp_attention=True)
    eplb = replace(dp, eplb=32)
    tbo = replace(eplb, overlap=True)
    out = {"today tp-attn b32": Layout(ep=ep, batch=32, context=2000), "dp": dp, "dp+eplb": eplb,
           "dp+eplb+tbo": tbo, "dp+eplb+tbo+mtp1 a0.82": replace(tbo, mtp=1, accept=(ACCEPT_EMBEDDED,))}
    for a in ACCEPT_DEEPSEEK:
        out[f"dp+eplb+tbo+mtp1 a{a:.2f}"] = replace(tbo, mtp=1, accept=(a,))
    return out


def measure_grid(trace: Path = ep_balance.DEFAULT_TRACE) -> list[dict]:
    """DeepSeek-V3 and GLM-5 on H100 and H200 at EP 8, 32, 72, 96 in every `grid_layouts` layout;
    a layout the model cannot take is a row with its refusal."""
    rows = []
    for name in ("deepseek-v3", "glm-5"):
        for hw in ("h100", "h200"):
            for ep in (8, 32, 72, 96):
                for label, layout in grid_layouts(ep).items():
                    try:
                        row = run(MODELS[name], HARDWARE[hw], layout, trace)
                    except ValueError as exc:
                        row = {"model": name, "hw": hw, "ep": ep, "refused": str(exc)}
                    rows.append({"layout": label, **row})
    return rows


def batch_series(trace: Path = ep_balance.DEFAULT_TRACE) -> dict[str, list[dict]]:
    """Tokens/s per node against batch per GPU for the plot: DeepSeek-V3 at SGLang's scale and
    today's layout on one node."""
    batches = (8, 16, 32, 64, 128, 256, 512)
    base = Layout(ep=72, batch=1, context=2000, dp_attention=True, eplb=32)
    series = {"h100 ep72 dp+eplb": base, "h100 ep72 dp+eplb+tbo": replace(base, overlap=True),
              "h100 ep72 dp+eplb+tbo+mtp1 a0.85": replace(base, overlap=True, mtp=1, accept=(0.85,)),
              "h200 ep72 dp+eplb+tbo": replace(base, overlap=True)}
    out = {label: [run(MODELS["deepseek-v3"], HARDWARE[label.split()[0]], replace(layout, batch=b), trace)
                   for b in batches] for label, layout in series.items()}
    for hw in ("h100", "h200"):
        out[f"{hw} ep8 today tp-attn"] = [run(MODELS["deepseek-v3"], HARDWARE[hw], Layout(ep=8, batch=b, context=2000),
                                              trace) for b in batches]
    return out


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="deepseek-v3", help=f"one of {', '.join(MODELS)}")
    ap.add_argument("--hw", default="h100", help=f"one of {', '.join(HARDWARE)}")
    ap.add_argument("--ep", type=int, default=8, help="GPUs in the EP group")
    ap.add_argument("--dp-attention", action="store_true", help="data-parallel attention + all-to-all experts")
    ap.add_argument("--eplb", type=int, default=None, metavar="R", help="EPLB placement with R redundant experts")
    ap.add_argument("--overlap", action="store_true", help="two-batch overlap")
    ap.add_argument("--mtp", type=int, default=0, help="MTP drafts a step")
    ap.add_argument("--accept", default="", help="acceptance per draft position (one value repeats)")
    ap.add_argument("--batch", type=int, default=256, help="sequences per GPU")
    ap.add_argument("--context", type=int, default=2000, help="tokens of context a sequence")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--peak", action="store_true", help="bare roofline: no published efficiency fractions")
    ap.add_argument("--load", type=float, default=None, help="max/mean rank load of the routed experts "
                    "(instead of the one measured on --trace): a what-if for a measured production imbalance")
    ap.add_argument("--trace", type=Path, default=ep_balance.DEFAULT_TRACE, help="routing trace (tools/ep_balance.py)")
    ap.add_argument("--sweep", default="", help="comma list of batches per GPU: a table and a plot over them")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of tokens/s per node against batch (with --sweep)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--reproduce-sglang", action="store_true", help="SGLang's 96-H100 decode figure, and EP 8 today")
    ap.add_argument("--grid", action="store_true", help="DeepSeek-V3 and GLM-5, H100 and H200, EP 8/32/72/96, "
                    "every layout; with --json-out and --plot")
    args = ap.parse_args(argv)
    try:
        if args.reproduce_sglang:
            rep = reproduce_sglang(args.trace)
            print_table([rep["sglang_layout"], *rep["today_tp_attention_ep8"], *rep["deepseek_profile"]])
            print("DeepSeek's balanced-routing decode profile: predicted / published "
                  + ", ".join(f"{r:.3f}" for r in rep["deepseek_profile_ratios"]) + " (no MTP, one draft at 0.85)")
            print(f"SGLang layout predicted {rep['sglang_layout']['tok_s_per_node']:.0f} tok/s per node, published "
                  f"{rep['published_tok_s_per_node']:.0f}: ratio {rep['ratio']:.3f}")
            if args.json_out:
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                args.json_out.write_text(json.dumps(rep, indent=1) + "\n")
            return 0
        if args.grid:
            return _write_grid(args)
        if args.model not in MODELS:
            raise ValueError(f"unknown model {args.model!r} (expected one of {', '.join(MODELS)})")
        if args.hw not in HARDWARE:
            raise ValueError(f"unknown hardware {args.hw!r} (expected one of {', '.join(HARDWARE)})")
        accept = _floats(args.accept)
        if len(accept) == 1 and args.mtp > 1:
            accept = accept * args.mtp
        base = Layout(ep=args.ep, batch=args.batch, context=args.context, dp_attention=args.dp_attention,
                      eplb=args.eplb, overlap=args.overlap, mtp=args.mtp, accept=accept,
                      kv_bytes=1 if args.kv_dtype == "fp8" else 2, peak=args.peak)
        model, hw = MODELS[args.model], HARDWARE[args.hw]
        batches = [int(b) for b in args.sweep.split(",") if b.strip()] or [args.batch]
        rows = [run(model, hw, replace(base, batch=b), args.trace, args.load) for b in batches]
    except ValueError as exc:
        ap.error(str(exc))
    print_table(rows)
    if args.plot:
        plot({f"{args.model} {args.hw} EP{args.ep}": rows}, args.plot, " ".join(sys.argv[1:]))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
    return 0


def _write_grid(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    from bench.report import provenance
    start = provenance()
    rows, series, rep = measure_grid(args.trace), batch_series(args.trace), reproduce_sglang(args.trace)
    print_table([r for r in rows if "refused" not in r])
    for r in rows:
        if "refused" in r:
            print(f"{r['model']} {r['hw']} EP{r['ep']} {r['layout']}: refused: {r['refused']}")
    print(f"SGLang layout predicted {rep['sglang_layout']['tok_s_per_node']:.0f} tok/s per node, published "
          f"{rep['published_tok_s_per_node']:.0f}: ratio {rep['ratio']:.3f}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({**start, "trace": str(Path(args.trace).name), "efficiency": EFFICIENCY,
                                             "collective_floor_us": COLLECTIVE_FLOOR_S * 1e6, "grid": rows,
                                             "batch_series": series, "sglang": rep}, indent=1) + "\n")
    if args.plot:
        layout = SGLANG_96_H100["layout"]
        plot(series, args.plot, "DeepSeek-V3 decode, 2,000-token context: predicted tokens/s per node",
             ("SGLang, 72 H100 decode (published)", layout.batch, SGLANG_96_H100["tok_s_per_node"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
