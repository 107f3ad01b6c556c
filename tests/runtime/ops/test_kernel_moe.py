"""The fused MoE kernels (runtime/ops/kernels/fused_moe.py) against the routed experts' reference loop
(`RoutedExperts._looped`, float64) and its accelerator path: float32 and bfloat16, experts with no
rows, with more rows than a block, non-local choices (an EP shard), one row; under the Triton
interpreter on the CPU, compiled in the `cuda` test."""
from __future__ import annotations

import pytest
import torch

from runtime.model.experts import RoutedExperts
from tests.runtime.ops.kernel_cases import kernel_device

pytestmark = pytest.mark.triton


def experts(num: int, hidden: int, inter: int, offset: int = 0, seed: int = 0) -> RoutedExperts:
    g = torch.Generator().manual_seed(seed)
    m = RoutedExperts(num, hidden, inter, expert_offset=offset)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * 0.2)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * 0.2)
    return m.requires_grad_(False)


def case(t: int, k: int, num_global: int, skew: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if skew:   # most choices on expert 2: more rows than one block
        ids = torch.stack([torch.randperm(num_global, generator=g)[:k] for _ in range(t)])
        ids[:, 0] = 2
    else:
        ids = torch.stack([torch.randperm(num_global, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    return ids, w


def check(device, dtype, t, k, e_local, offset, num_global, skew, hidden=48, inter=40):
    from runtime.ops.kernels.fused_moe import fused_experts
    m = experts(e_local, hidden, inter, offset)
    ids, w = case(t, k, num_global, skew)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(3))
    want = m.double()._looped(x.double(), w.double(), ids)
    got = fused_experts(x.to(dtype).to(device), w.to(dtype).to(device), ids.to(device),
                        m.gate_up_proj.to(dtype).to(device), m.down_proj.to(dtype).to(device), offset)
    assert got.dtype == dtype and got.shape == (t, hidden)
    tol = 1e-5 if dtype == torch.float32 else 3e-2 * want.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol if dtype == torch.float32 else 0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_match_the_reference(dtype):
    dev = kernel_device()
    check(dev, dtype, t=12, k=2, e_local=8, offset=0, num_global=8, skew=False)   # some experts empty
    check(dev, dtype, t=20, k=2, e_local=8, offset=0, num_global=8, skew=True)    # expert 2: 20 rows > a block


def test_fused_experts_shard_and_one_row():
    dev = kernel_device()
    check(dev, torch.float32, t=9, k=3, e_local=4, offset=4, num_global=12, skew=False)   # non-local choices
    check(dev, torch.float32, t=1, k=2, e_local=8, offset=0, num_global=8, skew=False)


def test_block_layout_is_read_off_the_device_only():
    kernel_device()
    from runtime.ops.kernels.fused_moe import block_layout
    ids = torch.tensor([[1, 3], [1, 9], [3, 1], [0, 1]])   # 9: another shard's
    order, end, block_expert, block_row = block_layout(ids, 0, 4, block_m=2)
    assert end.tolist() == [1, 5, 5, 7]
    # expert 0: one block, expert 1 (4 choices): two, expert 3: one; the rest -1
    assert block_expert.tolist()[:4] == [0, 1, 1, 3] and set(block_expert.tolist()[4:]) == {-1}
    assert block_row.tolist()[:4] == [0, 1, 3, 5]
    assert len(block_expert) == 8 // 2 + 4


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_on_the_gpu(dtype):
    check(torch.device("cuda", 0), dtype, t=64, k=4, e_local=16, offset=0, num_global=16, skew=True,
          hidden=256, inter=128)


def fp8_experts(num: int, hidden: int, inter: int, block: tuple[int, int], seed: int = 0):
    """FP8 expert weights and scales as the loader keeps them (gate and up blocked apart), and the
    same weights dequantized (float32)."""
    from runtime.model.quantization import dequantize, quantize
    g = torch.Generator().manual_seed(seed)
    gu, gu_s, dn, dn_s = [], [], [], []
    for _ in range(num):
        halves = [quantize(torch.randn(inter, hidden, generator=g) * 0.2, block) for _ in range(2)]
        gu.append(torch.cat([q for q, _ in halves]))
        gu_s.append(torch.stack([s for _, s in halves]))
        q, s = quantize(torch.randn(hidden, inter, generator=g) * 0.2, block)
        dn.append(q)
        dn_s.append(s)
    gu, gu_s, dn, dn_s = map(torch.stack, (gu, gu_s, dn, dn_s))
    gu_dense = torch.stack([torch.cat([dequantize(w, s, block) for w, s in zip(gu[e].chunk(2), gu_s[e])])
                            for e in range(num)])
    dn_dense = torch.stack([dequantize(dn[e], dn_s[e], block) for e in range(num)])
    return (gu, dn, gu_s, dn_s), (gu_dense, dn_dense)


def check_fp8(device, dtype, t, k, e_local, offset, num_global, hidden, inter, block):
    """The FP8 experts equal the fused kernels on the dequantized weights rounded to `dtype`, which
    are what dequantizing on load serves: each tile is decoded, scaled and rounded the same way."""
    from runtime.ops.kernels.fused_moe import fused_experts
    (gu, dn, gu_s, dn_s), (gu_dense, dn_dense) = fp8_experts(e_local, hidden, inter, block)
    ids, w = case(t, k, num_global, skew=True)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    w, ids = w.to(dtype).to(device), ids.to(device)
    got = fused_experts(x, w, ids, gu.to(device), dn.to(device), offset, gu_s.to(device), dn_s.to(device), block)
    want = fused_experts(x, w, ids, gu_dense.to(dtype).to(device), dn_dense.to(dtype).to(device), offset)
    assert got.dtype == dtype and want.abs().max() > 0.1
    if device.type == "cpu":   # the interpreter: the same products in the same order, bit for bit
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:   # compiled, the two may be scheduled apart: within a rounding of the output
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_equal_the_dequantized_ones(dtype):
    dev = kernel_device()
    check_fp8(dev, dtype, t=20, k=2, e_local=4, offset=0, num_global=4, hidden=48, inter=40, block=(16, 24))
    check_fp8(dev, dtype, t=7, k=3, e_local=3, offset=3, num_global=9, hidden=40, inter=24, block=(16, 16))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_on_the_gpu(dtype):
    check_fp8(torch.device("cuda", 0), dtype, t=64, k=4, e_local=16, offset=0, num_global=16, hidden=256,
              inter=192, block=(128, 128))


def test_the_model_through_the_fused_experts_matches_the_default():
    """The embedded model's forward with every routed expert layer on the fused kernels equals the
    default path (float32), and the choice is refused in one line where the kernels cannot run."""
    kernel_device()
    from pathlib import Path

    from runtime.executor.attention import PagedAttention, SeqChunk, build_plan
    from runtime.model.experts import choose_fused_experts, uses_fused_experts
    from runtime.executor.kv_cache import PagedKVCache
    from runtime.executor.runner import cache_layers
    from runtime.model.weights import load_model
    model = load_model(Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe", "float32", device="cpu")
    assert not uses_fused_experts(model)   # never chosen on the CPU by default
    outs = []
    for on in (False, True):
        choose_fused_experts(model, on)
        cache = PagedKVCache(num_layers=cache_layers(model), num_blocks=8, block_size=16, dtype=model.dtype,
                             device="cpu", **model.cache_layout())
        cache.reserve(0, 6)
        plan = build_plan(cache, [SeqChunk(0, 0, 6)])
        with torch.inference_mode():
            outs.append(model(torch.tensor([5, 17, 200, 3, 9, 11]), plan.positions, PagedAttention(cache, plan)))
    assert uses_fused_experts(model)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="fused MoE kernels cannot run here"):
        choose_fused_experts(model.double(), True)
