"""The block-scaled FP8 linear kernel (runtime/ops/kernels/fp8_linear.py) against dequantize-then-matmul
(`runtime.model.quantization.dequantize`, float64): every e4m3 code, ragged M/N/K against the blocks,
bias, windows starting inside a block (an EP rank's rows or columns), float32 and bfloat16; under
the Triton interpreter on the CPU, compiled in the `cuda` test."""
from __future__ import annotations

import pytest
import torch

from runtime.model.quantization import FP8, dequantize, quantize, scale_window
from tests.runtime.ops.kernel_cases import kernel_device

pytestmark = pytest.mark.triton


def test_every_e4m3_code_decodes_exactly():
    dev = kernel_device()
    from runtime.ops.kernels.fp8_linear import fp8_linear
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                       # not the two NaNs
    w = codes.view(FP8)[None, :]                                # [1, 254]: subnormals, zeros, both signs
    eye = torch.eye(w.shape[1], device=dev)
    got = fp8_linear(eye, w.to(dev), torch.ones(1, 1, device=dev), None, (16, 256))[:, 0]
    assert torch.equal(got.cpu(), w.float()[0])


def weight(n: int, k: int, block: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0.5, k)   # blocks of different scales
    return quantize(w, block)


def check(dev, dtype, m, n, k, block, bias, window=None):
    from runtime.ops.kernels.fp8_linear import fp8_linear
    q, s = weight(n, k, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    offset = (0, 0)
    if window is not None:   # a rank's rows (dim 0) or columns (dim 1) of the stored weight
        dim, start, stop = window
        lo, hi = scale_window(dim, start, stop, block)
        if dim == 0:
            q, s, b = q[start:stop], s[lo:hi], None if b is None else b[start:stop]
            offset = (start % block[0], 0)
        else:
            q, s, x = q[:, start:stop], s[:, lo:hi], x[:, start:stop]
            offset = (0, start % block[1])
    w = dequantize(q, s, block, offset[0], offset[1], dtype=torch.float64)
    want = x.double() @ w.t() + (0 if b is None else b.double())
    got = fp8_linear(x.to(dev), q.to(dev), s.to(dev), None if b is None else b.to(dev), block, offset)
    assert got.dtype == dtype and got.shape == want.shape
    got = got.cpu().double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:   # float32 sums rounded once to bfloat16: within half a bfloat16 step of the exact result
        step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert ((got - want).abs() <= step / 2 * 1.01 + 1e-6 * want.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_shapes_against_dequantize_then_matmul(dtype):
    dev = kernel_device()
    check(dev, dtype, m=5, n=70, k=53, block=(16, 24), bias=True)       # partial blocks both ways
    check(dev, dtype, m=1, n=33, k=130, block=(128, 128), bias=False)    # one decode row, a release block
    check(dev, dtype, m=19, n=40, k=64, block=(16, 16), bias=False)      # more rows than a tile


@pytest.mark.parametrize("window", [(0, 7, 45), (0, 32, 48), (1, 5, 50), (1, 24, 53)])
def test_windows_starting_inside_a_block(window):
    check(kernel_device(), torch.float32, m=3, n=70, k=53, block=(16, 24), bias=True, window=window)


def test_rows_do_not_depend_on_the_batch():
    dev = kernel_device()
    from runtime.ops.kernels.fp8_linear import fp8_linear
    q, s = weight(40, 50, (16, 24))
    x = torch.randn(21, 50, generator=torch.Generator().manual_seed(2))
    full = fp8_linear(x, q, s, None, (16, 24))
    for rows in (slice(0, 1), slice(3, 20)):
        assert torch.equal(fp8_linear(x[rows].to(dev), q, s, None, (16, 24)), full[rows])
    assert fp8_linear(x[:0], q, s, None, (16, 24)).shape == (0, 40)
    with pytest.raises(ValueError, match="features"):
        fp8_linear(x[:, :49], q, s, None, (16, 24))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_on_the_gpu(dtype):
    dev = torch.device("cuda", 0)
    check(dev, dtype, m=37, n=300, k=520, block=(128, 128), bias=True)
    check(dev, dtype, m=1, n=200, k=256, block=(128, 128), bias=False, window=(0, 72, 200))
    check(dev, dtype, m=4, n=200, k=384, block=(128, 128), bias=False, window=(1, 64, 320))
