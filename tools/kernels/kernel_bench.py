"""The Triton kernels against the paths they replace, one JSON line per cell (`make gpu-check` runs it).

    python tools/kernels/kernel_bench.py --device cuda            # on a GPU: bfloat16, the served shapes
    python tools/kernels/kernel_bench.py --device cpu --smoke     # tiny shapes, under TRITON_INTERPRET=1

attention: a static step's attention of one layer (`PagedAttention.attend` over a `StaticBuffers`
plan) through the paged kernel against the context copy + padded SDPA, for decode steps of B
sequences over contexts of C keys (GLM-4.5-Air-like heads: 96 query, 8 kv, dim 128), with the
bytes of keys and values read over the time (GB/s). experts: the fused MoE kernels against the
grouped-matmul path (`RoutedExperts._grouped`) for T rows (128 experts, k 8, hidden 4096,
intermediate 1536 on a GPU), and the same kernels reading the experts in FP8 with 128x128 block
scales (`fused_fp8`, as an FP8 checkpoint's experts are served on CUDA). sampling: the sampling kernel's backend against the reference
sampler (`sample_rows`: per-row processing and sort), N rows of a 151552-token vocabulary at
temperature 0.8, top-k 50, top-p 0.95, each arm ending in its host read of the tokens. fp8_linear:
the block-scaled FP8 linear kernel (weights kept in e4m3 with 128x128 scale blocks, as an FP8
checkpoint is served on CUDA) against `F.linear` on the same weights dequantized to the serving
dtype (what the CPU serves), for M rows through DeepSeek-V3 / GLM-5-like projections (half an o_proj,
7168x8192, q_b_proj 24576x1536), with the weight bytes each arm reads over its time (GB/s). Each
cell alternates the two arms and keeps the median of the timings (CUDA events on a GPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

FULL = {"attention": {"heads": (96, 8, 128), "seqs": (1, 8, 64), "keys": (1024, 8192)},
        "experts": {"shape": (128, 8, 4096, 1536), "rows": (1, 8, 64, 512), "block": (128, 128)},
        "sampling": {"vocab": 151552, "rows": (1, 8, 64)},
        "fp8_linear": {"shapes": ((7168, 8192), (24576, 1536)), "block": (128, 128), "rows": (1, 16, 512)}}
SMOKE = {"attention": {"heads": (4, 2, 16), "seqs": (1,), "keys": (40,)},
         "experts": {"shape": (8, 2, 32, 32), "rows": (4,), "block": (16, 16)},
         "sampling": {"vocab": 300, "rows": (2,)},
         "fp8_linear": {"shapes": ((48, 80),), "block": (16, 32), "rows": (3,)}}


def timed(fns: dict, device: torch.device, reps: int) -> dict:
    """Median seconds of each function, the arms alternating."""
    times: dict = {k: [] for k in fns}
    for fn in fns.values():
        fn()   # warm-up (compiles the kernels)
    for _ in range(reps):
        for name, fn in fns.items():
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def attention_cells(device: torch.device, dtype: torch.dtype, sizes: dict, reps: int):
    from runtime.executor.attention import PagedAttention, SeqChunk
    from runtime.ops.kernels.paged_attention import paged_attention
    from runtime.executor.kv_cache import PagedKVCache
    from runtime.executor.attention import KernelAttention, padded_backend
    from runtime.executor.static_step import StaticBuffers, static_shape
    nh, nkv, d = sizes["heads"]
    for keys in sizes["keys"]:
        for b in sizes["seqs"]:
            cache = PagedKVCache(num_layers=1, num_blocks=b * (keys // 16 + 1), block_size=16, num_kv_heads=nkv,
                                 head_dim=d, dtype=dtype, device=device)
            cache.k.normal_()
            cache.v.normal_()
            chunks = []
            for s in range(b):
                cache.reserve(s, keys)
                chunks.append(SeqChunk(s, keys - 1, 1))
            shape = static_shape(chunks, keys)
            plans = {}
            padded = padded_backend(cache.device)
            for arm, backend in (("kernel", KernelAttention(paged_attention, padded)), ("sdpa", padded)):
                buffers = StaticBuffers(shape, cache, backend=backend)
                buffers.fill([1] * b, chunks, cache)
                plans[arm] = buffers.plan
            t = shape.num_tokens
            q = torch.randn(t, nh, d, dtype=dtype, device=device)
            kv = torch.randn(t, nkv, d, dtype=dtype, device=device)
            fns = {arm: (lambda p=p: PagedAttention(cache, p).attend(0, q, kv, kv, d ** -0.5)) for arm, p in plans.items()}
            med = timed(fns, device, reps)
            read = b * keys * nkv * d * 2 * dtype.itemsize
            yield {"kernel": "paged_attention", "seqs": b, "keys": keys, "heads": f"{nh}/{nkv}x{d}",
                   "dtype": str(dtype).removeprefix("torch."), "kernel_us": round(med["kernel"] * 1e6, 1),
                   "sdpa_us": round(med["sdpa"] * 1e6, 1), "sdpa_over_kernel": round(med["sdpa"] / med["kernel"], 2),
                   "kernel_gb_s": round(read / med["kernel"] / 1e9, 1)}


def expert_cells(device: torch.device, dtype: torch.dtype, sizes: dict, reps: int):
    from runtime.model.experts import RoutedExperts
    from runtime.ops.kernels.fused_moe import fused_experts
    e, k, h, i = sizes["shape"]
    g = torch.Generator(device="cpu").manual_seed(0)
    m = RoutedExperts(e, h, i)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * 0.02)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * 0.02)
    m = m.to(device=device, dtype=dtype).requires_grad_(False)
    fp8 = fp8_experts(m, sizes["block"])
    for t in sizes["rows"]:
        x = torch.randn(t, h, generator=g).to(device=device, dtype=dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
        w = torch.rand(t, k, generator=g).to(device=device, dtype=dtype)
        fns = {"fused": lambda: fused_experts(x, w, ids, m.gate_up_proj, m.down_proj, 0),
               "grouped": lambda: RoutedExperts._grouped(m, x, w, ids),
               "fused_fp8": lambda: fused_experts(x, w, ids, fp8[0], fp8[1], 0, fp8[2], fp8[3], sizes["block"])}
        with torch.inference_mode():
            med = timed(fns, device, reps)
        yield {"kernel": "fused_moe", "rows": t, "experts": f"{e} k{k} {h}x{i}", "dtype": str(dtype).removeprefix("torch."),
               "fused_us": round(med["fused"] * 1e6, 1), "grouped_us": round(med["grouped"] * 1e6, 1),
               "grouped_over_fused": round(med["grouped"] / med["fused"], 2), "fused_fp8_us": round(med["fused_fp8"] * 1e6, 1),
               "fused_over_fused_fp8": round(med["fused"] / med["fused_fp8"], 2)}


def fp8_experts(m, block: tuple[int, int]):
    """`m`'s experts quantized as an FP8 checkpoint stores them and the loader keeps them: (gate_up
    [E, 2I, H] e4m3, down [E, H, I] e4m3, gate_up scales [E, 2, ...] with gate and up blocked apart,
    down scales [E, ...]), quantized on `m`'s device one matrix at a time."""
    from runtime.model.quantization import quantize
    gu, gu_s, dn, dn_s = [], [], [], []
    for e in range(m.num_local_experts):
        halves = [quantize(h, block) for h in m.gate_up_proj[e].chunk(2)]
        gu.append(torch.cat([q for q, _ in halves]))
        gu_s.append(torch.stack([s for _, s in halves]))
        q, s = quantize(m.down_proj[e], block)
        dn.append(q)
        dn_s.append(s)
    return tuple(torch.stack(t) for t in (gu, dn, gu_s, dn_s))


def sampling_cells(device: torch.device, dtype: torch.dtype, sizes: dict, reps: int):
    from runtime.executor.sampling import KERNEL, REFERENCE
    from runtime.sample.sampler import RowSpec, SamplingParams
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    g = torch.Generator(device="cpu").manual_seed(0)
    for n in sizes["rows"]:
        logits = (torch.randn(n, sizes["vocab"], generator=g) * 3).to(device=device, dtype=dtype)
        rows = [RowSpec(params, i, 1000 + i) for i in range(n)]
        fns = {"kernel": lambda: KERNEL.sample_rows(logits, rows), "reference": lambda: REFERENCE.sample_rows(logits, rows)}
        same = [s.token for s in fns["kernel"]()] == [s.token for s in fns["reference"]()]
        with torch.inference_mode():
            med = timed(fns, device, reps)
        yield {"kernel": "sampling", "rows": n, "vocab": sizes["vocab"], "dtype": str(dtype).removeprefix("torch."),
               "params": "t0.8 k50 p0.95", "same_tokens": same, "kernel_us": round(med["kernel"] * 1e6, 1),
               "reference_us": round(med["reference"] * 1e6, 1),
               "reference_over_kernel": round(med["reference"] / med["kernel"], 2)}


def fp8_linear_cells(device: torch.device, dtype: torch.dtype, sizes: dict, reps: int):
    import torch.nn.functional as F

    from runtime.model.quantization import dequantize, quantize
    from runtime.ops.kernels.fp8_linear import fp8_linear
    block = sizes["block"]
    g = torch.Generator(device="cpu").manual_seed(0)
    for n, k in sizes["shapes"]:
        q, s = quantize(torch.randn(n, k, generator=g).to(device) * 0.02, block)   # on the device: seconds less
        dense = dequantize(q, s, block).to(dtype)
        for m in sizes["rows"]:
            x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
            fns = {"fp8": lambda: fp8_linear(x, q, s, None, block), "dense": lambda: F.linear(x, dense)}
            with torch.inference_mode():
                med = timed(fns, device, reps)
                err = (fns["fp8"]().float() - fns["dense"]().float()).abs().max().item()
            yield {"kernel": "fp8_linear", "rows": m, "weight": f"{n}x{k}", "block": f"{block[0]}x{block[1]}",
                   "dtype": str(dtype).removeprefix("torch."), "fp8_us": round(med["fp8"] * 1e6, 1),
                   "dense_us": round(med["dense"] * 1e6, 1), "dense_over_fp8": round(med["dense"] / med["fp8"], 2),
                   "fp8_gb_s": round((q.nbytes + s.nbytes) / med["fp8"] / 1e9, 1),
                   "dense_gb_s": round(dense.nbytes / med["dense"] / 1e9, 1), "max_abs_diff": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU under the Triton interpreter)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--json-out", type=Path, default=None, help="append one JSON line per cell here")
    args = ap.parse_args(argv)
    from runtime.ops import kernels
    device = torch.device(args.device)
    if not kernels.available(device.type):
        print(f"kernel bench: the Triton kernels cannot run on {device} here (triton missing, or TRITON_INTERPRET "
              "not 1 for the CPU)", file=sys.stderr)
        return 2
    sizes = SMOKE if args.smoke else FULL
    reps = args.reps or (1 if args.smoke else 20)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for cell in [*attention_cells(device, dtype, sizes["attention"], reps),
                 *expert_cells(device, dtype, sizes["experts"], reps),
                 *sampling_cells(device, dtype, sizes["sampling"], reps),
                 *fp8_linear_cells(device, dtype, sizes["fp8_linear"], reps)]:
        line = json.dumps(cell)
        print(line, flush=True)
        if args.json_out:
            with args.json_out.open("a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
