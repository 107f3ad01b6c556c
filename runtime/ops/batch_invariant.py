"""Batch-invariant kernels: a row's result does not depend on how many rows share the call.

On the CPU with the native library (`runtime.ops.cpu_ops`), float32 and bfloat16 take the native
kernels that already sum each row in an order of its own, at every row count: `linear` the
few-row kernel (`cpu_ops.invariant_linear`), the routed experts the native op on it
(`runtime.model.experts._native_invariant_experts`), attention the native op's in-place rows
(`runtime.executor.attention._invariant_plan`); docs/design.md §3.2. What follows is what the
Python kernels here do where that library is not loaded, on accelerators, and in float64's
attention and experts.

Why a row can change with its neighbours (measured on this CPU build, torch 2.13, MKL and
oneDNN; `tests/runtime/ops/test_batch_invariant.py` checks every claim below on the machine it
runs on):
- A GEMM picks its kernel by its row count, and each kernel rounds differently: with row-major
  weights float32 has three classes (1 row, 2-9 rows, 15 rows and more) and bfloat16 changes at
  33 rows for the dense MLP's down projection (visible only on real activations: random data
  rarely crosses a bfloat16 rounding step). `linear` calls the GEMM on row counts that
  `gemm_plan` measured to give every row one result (with column-major weights: 2..64 rows in
  float32, 1..64 in bfloat16 for most shapes), or else on fixed tiles of exactly `MIN_ROWS`
  rows, the last one padded, so every call has one shape.
- Attention over a padded batch (`runtime.ops.invariant_attention`): the number of keys a softmax and its weighted sum run over
  is the longest context in the step, and a row's query count picks the kernel (SDPA's CPU
  kernel rounds a row of a 4-row chunk otherwise than the same row alone, and a key placed
  after a masked hole otherwise than the same key without the hole). `attention` gives every
  query row a batch entry of its own over its own key list, in position order from index 0 (a
  tree row: the committed context, then its ancestors by depth), padded to a multiple of
  `KEY_CHUNK` and masked. On this CPU one SDPA call over such entries gives every row one result
  whatever the padding and the other entries (`sdpa_is_invariant` probes it per head shape,
  dtype and thread count). A sequence's key list is still gathered once: a short chain's rows
  are query heads of one entry (`chain_attention`), a prefill's entries share one expanded list.
  Elsewhere `tiled_attention` computes the same from matmuls of one
  fixed shape ([QUERY_TILE x g, D] x [D, KEY_CHUNK] per kv head, g query heads per kv head),
  the key dimension split into chunks of `KEY_CHUNK` whose partial sums are combined strictly
  in order (`cumsum`: chunks past a row's keys add exact zeros).
- Element-wise transcendental functions (exp, sigmoid) run vectorised over the flattened tensor
  and finish its last partial vector with scalar code that rounds differently. A row narrower
  than a vector (the router's 8 expert scores) therefore changes with the rows before it.
  `rowwise` pads such rows to whole vectors (`LANES`) first.
- RMSNorm, softmax, log-softmax and the top-k reduce within a row; they already are invariant.
- The routed experts run each touched expert's rows through `linear` (`RoutedExperts._per_expert`).
- Expert parallelism: an attention output projection is row-parallel (each rank sums over its
  heads, then the ranks' sums are all-reduced), which adds in another order than one rank's
  GEMM. One rank sums the projection in two halves of its heads (`split_linear`), each rank of
  EP 2 computes one half, so EP 2 adds what EP 1 adds. The routed experts' combine adds exact zeros for choices held elsewhere, and two
  ranks' all-reduce (a + b) is order-free; more ranks than 2 are not covered.

The float64 reference mode runs these kernels too (it is batch-invariant by default).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.ops import cpu_ops

MIN_ROWS = 16      # the fixed GEMM tile: every call has exactly this many rows (the uncalibrated plan)
MAX_TILE = 64      # the most rows a calibrated GEMM call takes
LANES = 32         # elements of the widest CPU vector (AVX-512, 16-bit types)

# (rows at least, rows at most) per GEMM call, by weight shape, strides, dtype, bias and threads.
_gemm_plans: dict[tuple, tuple[int, int]] = {}


def _probe(weight: torch.Tensor, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe rows and a probe weight of `weight`'s shape and strides whose products depend on the
    order of summation far more than real data's: channel pairs (j, j + K/2) carry +L and -L
    against equal weights, so the exact sum of each pair is 0 but the rounding a summation order
    leaves behind (|L w| x 2^-24) is far above a bfloat16 output's resolution. Real activations
    cross a bfloat16 rounding step on another kernel only rarely (one element in thousands), too
    rarely for a probe of plain rows to see."""
    gen = torch.Generator(device=weight.device).manual_seed(0)
    n, k = weight.shape
    w = torch.randn(n, k, generator=gen, device=weight.device) * 0.05
    x = torch.randn(rows, k, generator=gen, device=weight.device) * 0.3
    half = k // 2
    for j in range(1, half, max(1, half // 8)):
        w[:, j + half] = w[:, j]
        big = 2.0 ** 20 * torch.where(torch.rand(rows, generator=gen, device=weight.device) < 0.5, 1.0, -1.0)
        x[:, j], x[:, j + half] = big, -big
    probe_w = torch.empty_strided(weight.shape, weight.stride(), dtype=dtype, device=weight.device)
    probe_w.copy_(w)
    return x.to(dtype), probe_w


def gemm_plan(weight: torch.Tensor, dtype: torch.dtype, bias: bool) -> tuple[int, int]:
    """How many rows one GEMM call of `weight` may take while every row's result stays what a
    call of MAX_TILE rows gives it, wherever the row sits: (lo, hi), calls take lo..hi rows (fewer
    are padded to lo). Measured once per weight shape, layout, dtype, bias and thread count.

    Why: a GEMM library picks its kernel, blocking and thread split by the call's shape, and each
    choice may round differently. On this CPU build, with column-major weights (runtime.model.layers.
    pack_for_inference), float32 and float64 give every row count from 2 up one result and 1 row
    another; bfloat16 changes between 33 and 100 rows for some shapes, by thread count. Rather
    than trusting such facts, the plan is probed here: every row count 1..hi at the front and the
    back of a tile must equal the MAX_TILE call bit for bit, else hi halves (to 16), else the
    fixed tiles of exactly MIN_ROWS rows (one shape, invariant by construction). Kernel choice
    depends on shapes, not values, so equal results on probe rows mean the same reduction order
    on any rows (`_probe` makes the results sensitive to that order). Accelerators keep the fixed
    tiles."""
    if cpu_ops.invariant_linear(dtype, weight):   # `linear` runs the native kernel: any row count
        return 1, MAX_TILE
    key = (weight.shape, weight.stride(), dtype, weight.device.type, bias, torch.get_num_threads())
    plan = _gemm_plans.get(key)
    if plan is not None:
        return plan
    plan = (MIN_ROWS, MIN_ROWS)
    if weight.device.type == "cpu":
        x, w = _probe(weight, MAX_TILE, dtype)
        b = torch.full((w.shape[0],), 0.5, dtype=dtype, device=w.device) if bias else None
        for hi in (MAX_TILE, MIN_ROWS):
            ref = F.linear(x[:hi], w, b)
            lo = 1 if torch.equal(F.linear(x[:1], w, b), ref[:1]) else 2
            ok = all(torch.equal(F.linear(x[at:at + r], w, b), ref[at:at + r])
                     for r in range(max(lo, 2), hi) for at in {0, hi - r})
            if lo == 2:   # a single row is padded to two: the padding row sits after it
                ok = ok and torch.equal(F.linear(torch.cat((x[hi - 1:hi], x[:1])), w, b)[0], ref[hi - 1])
            if ok:
                plan = (lo, hi)
                break
    _gemm_plans[key] = plan
    return plan


# (rows at least, rows at most, equal to `linear`) per batched expert weight, or None.
_bmm_plans: dict[tuple, tuple[int, int, bool] | None] = {}


def bmm_plan(weight: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, bool] | None:
    """How many rows per expert one batched matmul of x [E, p, K] by `weight` [E, N, K]
    (transposed) may take while every row's result stays what a call of MAX_TILE rows gives it,
    wherever the row sits and however many experts the call batches: (lo, hi, same), p in
    lo..hi, `same` when each row also equals `linear`'s result for that expert's rows (then a
    layer may take the per-expert path or the padded one by its size and stay invariant). None
    when no range holds, and on accelerators. Probed as `gemm_plan` (bfloat16 here: 1..64, equal
    to `linear`; float32 changes below 11 rows)."""
    key = (weight.shape, weight.stride(), dtype, weight.device.type, torch.get_num_threads())
    if key in _bmm_plans:
        return _bmm_plans[key]
    plan = None
    if weight.device.type == "cpu" and weight.shape[0] >= 2:
        e = weight.shape[0]
        x1, w1 = _probe(weight[0], MAX_TILE, torch.float32)
        w = torch.empty_strided(weight.shape, weight.stride(), dtype=dtype, device=weight.device)
        w.copy_(torch.stack([w1 * (1 + 0.125 * i) for i in range(e)]))
        x = torch.stack([x1.roll(i, 0) for i in range(e)]).to(dtype)          # [E, MAX_TILE, K]
        wt = w.transpose(1, 2)
        for hi in (MAX_TILE, MIN_ROWS):
            ref = torch.bmm(x[:, :hi], wt)
            ok = torch.equal(torch.bmm(x[:e // 2, :hi], wt[:e // 2]), ref[:e // 2])   # fewer experts
            bad = [q for q in range(1, hi) if not all(torch.equal(torch.bmm(x[:, at:at + q], wt), ref[:, at:at + q])
                                                      for at in {0, hi - q})]
            lo = max(bad, default=0) + 1
            if ok:
                plan = (lo, hi, all(torch.equal(linear(x[i, :q], w[i]), ref[i, :q])
                                    for i in (0, e - 1) for q in range(1, hi + 1)))
                break
    _bmm_plans[key] = plan
    return plan


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           rows: tuple[int, int] | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose every output row is independent of the other rows of `x` [..., in]: the
    GEMM runs on calls of `gemm_plan` rows (the last call padded up to its least row count).
    In a compiled graph it is one opaque op (`metrale::bi_linear`), so the row count does not
    become a guard, unless `rows`, the weight's plan looked up before compiling (`plan_rows`),
    admits the step's row count, or is below it (one decode row where a one-row GEMM would take
    another kernel): then the graph calls the GEMM itself, on exactly the call a plan-sized
    `_linear` makes (padded with zero rows up to the least count), without the op's Python. The graph then holds one guard on the row count (a graph up to the plan's rows, one
    above; a row count below the least, a graph of its own, as Dynamo keeps for one row anyway).
    On the CPU with the native library (a column-major float32, bfloat16 or float64 weight:
    `cpu_ops.invariant_linear`) the native few-row kernel runs instead, on every row count: each
    output is summed in k order, whatever the rows, the threads or the column's place in the
    weight; from `packed` (`cpu_ops.pack` of the weight, the same bits) where given."""
    if cpu_ops.invariant_linear(x.dtype, weight):
        if packed is not None and packed.dtype == x.dtype:
            return torch.ops.metrale_cpu.linear(x, weight, bias, cpu_ops.ALL_ROWS, packed)
        return torch.ops.metrale_cpu.linear(x, weight, bias, cpu_ops.ALL_ROWS)
    if torch.compiler.is_compiling():
        if rows is not None and x.dim() == 2:
            n = x.shape[0]
            if rows[0] <= n <= rows[1]:
                return F.linear(x, weight, bias)
            if n < rows[0]:
                return F.linear(F.pad(x, (0, 0, 0, rows[0] - n)), weight, bias)[:n]
        return torch.ops.metrale.bi_linear(x, weight, bias)
    return _linear(x, weight, bias)


def plan_rows(weight: torch.Tensor, bias: bool, parts: int = 1) -> tuple[int, int]:
    """The `gemm_plan` of a linear's weight (of each of its `parts` slices, `split_linear`), looked
    up eagerly so a compiled graph reads it as a constant (`linear`'s `rows`)."""
    width = weight.shape[1] // parts
    return gemm_plan(weight[:, :width] if parts > 1 else weight, weight.dtype, bias and parts == 1)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The plan, kept on the weight for the thread count it was looked up at (a dict lookup of
    # its whole key costs as much again as this function's own work on a one-row GEMM).
    threads = torch.get_num_threads()
    kept = getattr(weight, "_bi_plan", None)
    key = (x.dtype, bias is None, threads, weight.stride())
    if kept is not None and kept[0] == key:
        lo, hi = kept[1]
    else:
        lo, hi = gemm_plan(weight, x.dtype, bias is not None)
        weight._bi_plan = (key, (lo, hi))
    if x.dim() == 2:
        if lo <= x.shape[0] <= hi:
            return F.linear(x, weight, bias)
        flat = x
    else:
        flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if lo <= n <= hi:
        return F.linear(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    if n < lo:
        out = F.linear(F.pad(flat, (0, 0, 0, lo - n)), weight, bias)
    else:
        tiles = list(flat.split(hi))
        if tiles[-1].shape[0] < lo:
            tiles[-1] = F.pad(tiles[-1], (0, 0, 0, lo - tiles[-1].shape[0]))
        out = torch.cat([F.linear(tile, weight, bias) for tile in tiles])
    return out[:n].reshape(*x.shape[:-1], weight.shape[0])


# The low-level registration, as runtime.executor.step_context's paged_attention (fewer wrappers per call).
torch.library.define("metrale::bi_linear", "(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
torch.library.impl("metrale::bi_linear", "CompositeExplicitAutograd")(_linear)


@torch.library.register_fake("metrale::bi_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def halves(num_heads: int) -> int:
    """The slices an attention output projection sums in batch-invariant mode: its two halves of
    heads (one per rank at EP 2), or 1 for an odd head count."""
    return 2 if num_heads % 2 == 0 else 1


def split_linear(x: torch.Tensor, weight: torch.Tensor, parts: int, rows: tuple[int, int] | None = None,
                 packed: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """`linear` over `parts` equal slices of the input features, the partial sums added as a
    balanced tree in slice order. An output projection is summed in two halves of its heads: at
    EP 2 each rank's row-parallel slice is one half, and the all-reduce of two ranks (a + b, order
    free) adds the same two sums as one rank. `packed`: each slice's `cpu_ops.pack` (`pack_parts`)."""
    width = weight.shape[1] // parts
    if width * parts != weight.shape[1]:
        raise ValueError(f"{weight.shape[1]} input features do not split into {parts} equal parts")
    sums = [linear(x[..., i * width:(i + 1) * width], weight[:, i * width:(i + 1) * width], rows=rows,
                   packed=None if packed is None else packed[i])
            for i in range(parts)]
    while len(sums) > 1:
        sums = [sums[i] + sums[i + 1] if i + 1 < len(sums) else sums[i] for i in range(0, len(sums), 2)]
    return sums[0]


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (element-wise) over x [..., W] with each row padded to whole vectors of LANES, so no
    element of a row ever takes the scalar tail path."""
    pad = -x.shape[-1] % LANES
    return fn(F.pad(x, (0, pad)))[..., :x.shape[-1]] if pad else fn(x)


class InvariantSwitch:
    """A module with a default and a batch-invariant way to compute. `switched` maps each
    attribute its forward calls (the class's own method: the default) to the name of its
    batch-invariant method; setting `batch_invariant` (`set_batch_invariant`, once) binds them,
    so no call reads the flag. `_switched(on)`, where a module has it, derives what else follows."""

    switched: dict[str, str] = {}
    _batch_invariant = False

    @property
    def batch_invariant(self) -> bool:
        return self._batch_invariant

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        object.__setattr__(self, "_batch_invariant", bool(on))
        for name, invariant in self.switched.items():
            if on:
                object.__setattr__(self, name, getattr(self, invariant))
            else:
                self.__dict__.pop(name, None)
        hook = getattr(self, "_switched", None)
        if hook is not None:
            hook(bool(on))


def set_batch_invariant(model: torch.nn.Module, on: bool) -> None:
    """Switch every module of `model` that has a batch-invariant path (`batch_invariant`); a
    linear's GEMM plan is looked up now (`bi_rows`: see `linear`). Weights in their final dtype
    and layout, and the thread count set, first."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = on
        if getattr(module, "fp8", None) is not None:   # an FP8-kept linear: its kernel is batch-invariant already
            continue
        if hasattr(module, "bi_rows"):
            parts = getattr(module, "in_parts", 1)
            bias = module.bias is not None and getattr(module, "gemm_takes_bias", True)
            module.bi_rows = (plan_rows(module.weight, bias, parts)
                              if on and module.weight.device.type != "meta" else None)
        if hasattr(module, "packed_parts"):
            module.packed_parts = pack_parts(module.weight, getattr(module, "in_parts", 1)) if on else None


def pack_parts(weight: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...] | None:
    """The packed copy (`cpu_ops.pack`) of each of `split_linear`'s `parts` slices of `weight`,
    which the native kernel reads instead of the slices (the same bits); None for one part, or
    where a slice is not packed (`cpu_ops.packs`)."""
    if parts == 1:
        return None
    width = weight.shape[1] // parts
    slices = [weight[:, i * width:(i + 1) * width] for i in range(parts)]
    if not all(cpu_ops.packs(w) and cpu_ops.invariant_linear(w.dtype, w) for w in slices):
        return None
    return tuple(cpu_ops.pack(w) for w in slices)
