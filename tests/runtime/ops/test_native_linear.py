"""The native few-row GEMM (`metrale_cpu::linear`, `runtime.model.layers.linear`): within rounding of
F.linear, each row's result its own (the same bits alone, in any batch, on any thread count), and
F.linear itself where it does not apply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.ops import cpu_ops
from runtime.model.layers import Linear, linear

BIG = 1 << 30


@pytest.fixture(autouse=True)
def native():
    assert cpu_ops.load(), cpu_ops.error()


def column_major(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, n, generator=g) * 0.1).to(dtype).t()   # [N, K], its transpose contiguous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n, k", [(8, 64), (40, 64), (512, 256), (4104, 96)])
def test_close_to_f_linear_and_rows_are_their_own(dtype, n, k):
    """Narrow (all tail), a tile and a tail, whole spans, many spans with a tail; 1 to 33 rows, with
    and without bias, 2-D and 3-D input."""
    w = column_major(n, k, dtype)
    bias = (torch.randn(n) * 0.1).to(dtype)
    x = torch.randn(33, k).to(dtype)
    full = torch.ops.metrale_cpu.linear(x, w, bias, BIG)
    want = F.linear(x.double(), w.double(), bias.double())
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 2e-2 * want.abs().max().item())
    assert full.dtype == dtype and full.shape == (33, n)
    assert (full.double() - want).abs().max() <= tol
    for rows in (1, 3, 4, 5, 16):
        assert torch.equal(torch.ops.metrale_cpu.linear(x[:rows], w, bias, BIG), full[:rows])
        assert torch.equal(torch.ops.metrale_cpu.linear(x[rows:rows + 1], w, bias, BIG)[0], full[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.metrale_cpu.linear(x, w, bias, BIG), full)
    finally:
        torch.set_num_threads(threads)
    x3 = x[:32].view(4, 8, k)
    assert torch.equal(torch.ops.metrale_cpu.linear(x3, w, None, BIG), torch.ops.metrale_cpu.linear(x[:32], w, None, BIG).view(4, 8, n))


def pair_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x . w^T summed as VDPBF16PS sums: a pair of k at a time, the odd one's product first, from
    zero, each product exact in float32 and each add rounded (an odd K's last k alone)."""
    xs, ws = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(0, x.shape[1], 2):
        if k + 1 < x.shape[1]:
            acc = acc + xs[:, k + 1:k + 2] * ws[:, k + 1]
        acc = acc + xs[:, k:k + 1] * ws[:, k]
    return acc


@pytest.mark.parametrize("n, k", [(32, 16), (40, 17), (96, 33), (512, 256), (256, 768)])
def test_bfloat16_sums_pairs_as_the_dot_product_instruction_does(n, k):
    """bfloat16 rows stay bfloat16 and each output is the pair sums' float, rounded once: the same
    bits on AVX512-BF16's instruction and on its float emulation (the path of CPUs without it),
    for 1 to 21 rows, tiles, tails and odd K."""
    w = column_major(n, k, torch.bfloat16)
    x = torch.randn(21, k).to(torch.bfloat16)
    want = pair_sums(x, w).to(torch.bfloat16)
    native = torch.ops.metrale_cpu.use_bf16_dot_products(True)   # whether this CPU has the instruction
    try:
        for on in (True, False):
            assert torch.ops.metrale_cpu.use_bf16_dot_products(on) == (on and native)
            for rows in (1, 2, 5, 8, 9, 21):
                assert torch.equal(torch.ops.metrale_cpu.linear(x[:rows], w, None, BIG), want[:rows]), (on, rows)
    finally:
        torch.ops.metrale_cpu.use_bf16_dot_products(True)


def test_bfloat16_output_rounds_the_sums_plus_bias_as_at_to_does():
    """The float sums plus the bias, rounded to bfloat16 by the kernel's own tasks: the bits of
    `Tensor.to(torch.bfloat16)` for ordinary and huge sums, infinities and NaN (as NaN)."""
    n, k = 300, 34
    w = column_major(n, k, torch.bfloat16)
    x = torch.randn(5, k).to(torch.bfloat16)
    x[1] *= 1e37                           # sums near the top of bfloat16's range
    x[2, 3] = float("inf")                 # infinities and, against zero weights' products, NaN
    w = w.clone()
    w[:7, 3] = 0
    bias = (torch.randn(n) * 0.1).to(torch.bfloat16)
    want = (pair_sums(x, w) + bias.float()).to(torch.bfloat16)
    got = torch.ops.metrale_cpu.linear(x, w, bias, BIG)
    assert got.isinf().any() and got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_column_is_its_own_in_any_slice_of_the_weight(dtype):
    """An EP rank holds a slice of an attention's heads (of the fused q/k/v outputs) or of the
    vocabulary: each output column is summed in k order wherever it sits, so a slice's GEMM gives
    the bits of the same columns in the whole matrix's GEMM (MKL's float64 GEMM does not, on AVX2)."""
    w = column_major(160, 64, dtype)
    x = torch.randn(11, 64).to(dtype)
    full = torch.ops.metrale_cpu.linear(x, w, None, BIG)
    for lo, hi in ((0, 64), (96, 128), (37, 160), (150, 153)):
        part = w[lo:hi].t().contiguous().t()   # the rank's own weight, column-major
        assert torch.equal(torch.ops.metrale_cpu.linear(x, part, None, BIG), full[:, lo:hi])


def test_float64_always_runs_the_kernel_and_batch_invariant_linear_uses_it():
    """float64 (the reference mode) takes every row count; `bi.linear` then needs no GEMM plan."""
    from runtime.ops import batch_invariant as bi
    w = column_major(96, 32, torch.float64)
    x = torch.randn(100, 32, dtype=torch.float64)
    assert cpu_ops.few_rows_max(torch.float64) >= cpu_ops.ALL_ROWS and cpu_ops.takes_all_rows(x.dtype, w)
    assert not cpu_ops.takes_all_rows(x.dtype, w.contiguous()) and not cpu_ops.takes_all_rows(torch.float32, w.float())
    want = torch.ops.metrale_cpu.linear(x, w, None, BIG)
    assert torch.equal(linear(x, w, None), want) and torch.equal(bi.linear(x, w), want)
    assert torch.equal(bi.linear(x[7:9], w), want[7:9])


@pytest.mark.parametrize("case", ["row-major weight", "more rows", "float16"])
def test_f_linear_where_the_kernel_does_not_apply(case):
    dtype = {"float16": torch.float16}.get(case, torch.float32)
    w = column_major(48, 32, dtype)
    if case == "row-major weight":
        w = w.contiguous()
    x = torch.randn(6, 32).to(dtype)
    max_rows = 4 if case == "more rows" else BIG
    assert torch.equal(torch.ops.metrale_cpu.linear(x, w, None, max_rows), F.linear(x, w))


def test_refuses_mismatched_shapes():
    with pytest.raises(RuntimeError, match="linear: x"):
        torch.ops.metrale_cpu.linear(torch.zeros(2, 8), torch.zeros(4, 6).t(), None, BIG)


def test_the_layer_compiles_into_one_graph_with_the_same_bits():
    """`Linear` calls the op straight from a compiled step (its fake gives the shape); no graph
    break, and the compiled result equals the eager one bit for bit."""
    torch.manual_seed(0)
    lin = Linear(64, 48)
    with torch.no_grad():
        lin.weight.data = lin.weight.data.t().contiguous().t()
    lin.choose_gemm()
    x = torch.randn(3, 64)
    with torch.no_grad():
        compiled = torch.compile(lin, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), lin(x))
        assert torch.equal(lin(x), torch.ops.metrale_cpu.linear(x, lin.weight, lin.bias, BIG))   # the kernel ran
        assert cpu_ops.few_rows_max(torch.float32) >= 3


def test_a_linear_chooses_its_gemm_once_and_again_after_a_move():
    """The GEMM is chosen per module (`choose_gemm`), not per call: F.linear until chosen, the native
    kernel on the CPU once chosen, F.linear again after a move to another dtype, until chosen anew."""
    from runtime.model.layers import choose_gemms, native_linear, plain_linear
    lin = Linear(16, 8)
    assert lin._gemm is plain_linear
    assert choose_gemms(torch.nn.Sequential(lin)) == {"native": 1}
    assert lin._gemm is native_linear
    lin.to(torch.float16)          # no native kernel for float16
    assert lin._gemm is plain_linear
    assert choose_gemms(torch.nn.Sequential(lin)) == {"torch": 1}


def test_training_keeps_autograd():
    """With gradients wanted, `linear` is F.linear (the native op has no backward)."""
    lin = Linear(16, 8)
    x = torch.randn(2, 16, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert torch.equal(linear(x, lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("n, k", [(32, 7), (96, 256), (192, 64), (288, 64), (544, 101), (4096, 96)])
def test_packed_weights_give_the_unpacked_bits(n, k):
    """`metrale_cpu::linear` from `cpu_ops.pack(w)` equals it from w alone bit for bit, with and
    without the dot-product instruction: one panel and a narrower last one, panels' boundaries
    inside a task's span, a span starting at a panel's second tile (192 columns), odd K, 1 to 33
    rows (every row-group and tile width), with and without bias, 3-D input."""
    w = column_major(n, k, torch.bfloat16)
    packed = cpu_ops.pack(w)
    assert packed.shape == (n, (k + 1) // 2, 2) and packed.dtype == torch.bfloat16
    x = torch.randn(33, k).to(torch.bfloat16)
    bias = (torch.randn(n) * 0.1).to(torch.bfloat16)
    native = torch.ops.metrale_cpu.use_bf16_dot_products(True)
    try:
        for on in (True, False):
            assert torch.ops.metrale_cpu.use_bf16_dot_products(on) == (on and native)
            for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33):
                for b in (None, bias):
                    want = torch.ops.metrale_cpu.linear(x[:rows], w, b, BIG)
                    got = torch.ops.metrale_cpu.linear(x[:rows], w, b, BIG, packed)
                    assert torch.equal(got, want), (on, rows)
        x3 = x[:32].view(4, 8, k)
        assert torch.equal(torch.ops.metrale_cpu.linear(x3, w, None, BIG, packed),
                           torch.ops.metrale_cpu.linear(x3, w, None, BIG))
    finally:
        torch.ops.metrale_cpu.use_bf16_dot_products(True)


@pytest.mark.parametrize("n, k", [(16, 7), (48, 256), (96, 64), (272, 101), (4096, 96)])
def test_packed_float32_weights_give_the_unpacked_bits(n, k):
    """float32 packed in 16-column panels: `metrale_cpu::linear` from `cpu_ops.pack(w)` equals it
    from w alone bit for bit: one panel, panels a span, odd K, 1 to 33 rows (every row group and
    panel count), with and without bias."""
    w = column_major(n, k, torch.float32)
    assert cpu_ops.packs(w)
    packed = cpu_ops.pack(w)
    assert packed.shape == (n, k) and packed.dtype == torch.float32
    x = torch.randn(33, k)
    bias = torch.randn(n) * 0.1
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33):
        for b in (None, bias):
            want = torch.ops.metrale_cpu.linear(x[:rows], w, b, BIG)
            assert torch.equal(torch.ops.metrale_cpu.linear(x[:rows], w, b, BIG, packed), want), rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_experts_give_the_unpacked_bits(dtype):
    """The routed experts' few-row GEMMs from packed matrices: the same bits as from the unpacked
    ones, for a whole layer and for a shard of it (rows routed elsewhere give zero)."""
    e, h, inter = 8, 64, 96
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(e, h, 2 * inter, generator=g) * 0.1).to(dtype).transpose(1, 2)
    down = (torch.randn(e, inter, h, generator=g) * 0.1).to(dtype).transpose(1, 2)
    for rows in (1, 4, 17):
        x = torch.randn(rows, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(rows)])
        weights = torch.rand(rows, 2, generator=g)
        for offset, gu, dn in ((0, gate_up, down), (4, gate_up[:4], down[:4])):
            want = torch.ops.metrale_cpu.routed_experts(x, weights, ids, gu, dn, offset, 3, 32)
            got = torch.ops.metrale_cpu.routed_experts(x, weights, ids, gu, dn, offset, 3, 32,
                                                       cpu_ops.pack(gu), cpu_ops.pack(dn))
            assert torch.equal(got, want), (rows, offset)


def test_pack_refuses_what_it_cannot_pack():
    assert not cpu_ops.packs(torch.zeros(40, 8, dtype=torch.bfloat16))     # N not a multiple of 32
    assert not cpu_ops.packs(torch.zeros(40, 8))                           # float32: N not a multiple of 16
    assert not cpu_ops.packs(torch.zeros(64, 8, dtype=torch.float64))      # float64: never
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_ops.pack(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_ops.pack(torch.zeros(40, 8))
    packed = cpu_ops.pack(column_major(64, 8, torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed bfloat16 weight"):   # packed for K = 8, x and w have 10
        torch.ops.metrale_cpu.linear(torch.zeros(2, 10, dtype=torch.bfloat16), column_major(64, 10, torch.bfloat16),
                                     None, BIG, packed)
    with pytest.raises(RuntimeError, match="packed float32 weight"):    # the same for float32
        torch.ops.metrale_cpu.linear(torch.zeros(2, 10), column_major(64, 10, torch.float32), None, BIG,
                                     cpu_ops.pack(column_major(64, 8, torch.float32)))
    with pytest.raises(RuntimeError, match="packed weight"):            # a packed copy of another type
        torch.ops.metrale_cpu.linear(torch.zeros(2, 8), column_major(64, 8, torch.float32), None, BIG, packed)


def test_a_packed_layer_uses_its_packed_copy_up_to_the_few_row_limit():
    """`pack_for_inference` keeps a packed copy of a bfloat16 layer's weight; `Linear` reads it for
    few rows (compiled too) and the unpacked weight above the limit, the same values either way;
    one compiled graph serves row counts on both sides of the limit (the op picks, no guard)."""
    from runtime.model.layers import pack_for_inference
    torch.manual_seed(0)
    lin = Linear(64, 96).to(torch.bfloat16)
    pack_for_inference(lin)
    assert lin.packed is not None and "packed" not in lin.state_dict()
    few = cpu_ops.few_rows_max(torch.bfloat16)
    with torch.no_grad():
        for rows in (1, 4, few, few + 1):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            assert torch.equal(lin(x), torch.ops.metrale_cpu.linear(x, lin.weight, lin.bias, few))
        torch._dynamo.reset()
        compiled = torch.compile(lin, fullgraph=True, dynamic=True)
        counters = torch._dynamo.utils.counters
        counters.clear()
        for rows in (3, 5, few + 3, 7):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            assert torch.equal(compiled(x), lin(x))
        assert counters["stats"]["unique_graphs"] == 1


def test_kernel_clock_counts_the_compute_ops_only_while_it_runs():
    import time
    w = column_major(512, 256, torch.float32)
    x = torch.randn(4, 256)
    cpu_ops.kernel_clock(False)                          # reset
    for _ in range(20):
        linear(x, w)
    assert cpu_ops.kernel_clock(True) == 0.0             # off: nothing counted
    t0 = time.perf_counter()
    for _ in range(20):
        linear(x, w)
    x.mul(2)                                             # not a compute op of the library
    wall = time.perf_counter() - t0
    counted = cpu_ops.kernel_clock(False)
    assert 0.0 < counted <= wall
    assert cpu_ops.kernel_clock(False) == 0.0            # each read starts the count again


def test_float32_few_row_limit_follows_avx512(monkeypatch):
    """float32 GEMMs of up to 32 rows take the kernel where it runs its AVX-512 tiles, 16 elsewhere
    (tools/few_rows_ab.py measures the limits); bfloat16 and float64 are not moved by it."""
    assert cpu_ops.load()
    tables = {}
    for avx512 in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda v=avx512: v)
        tables[avx512] = cpu_ops._few_rows_table()
    assert tables[True][torch.float32] == cpu_ops.FEW_ROWS_FLOAT32_AVX512 == 32
    assert tables[False][torch.float32] == cpu_ops.FEW_ROWS_FLOAT32 == 16
    assert tables[True][torch.bfloat16] == tables[False][torch.bfloat16]
    assert tables[True][torch.float64] == tables[False][torch.float64] == cpu_ops.ALL_ROWS
