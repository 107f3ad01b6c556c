"""The Triton paged-attention kernel (runtime/ops/kernels/paged_attention.py) against a float64
reference over the same cells: decode, chain-verify and tree-verify rows, grouped-query heads, the
latent (MLA absorbed) layout, split-K, float32 and bfloat16, ragged block tables, sequences with no
committed context, padding rows, and trees with and without siblings. On the CPU under the Triton
interpreter; the `cuda` test runs the compiled kernel."""
from __future__ import annotations

import pytest
import torch

from tests.runtime.ops.kernel_cases import kernel_device, ragged_cache

pytestmark = pytest.mark.triton

# (start, rows, parents) per sequence: decode rows, a chain, a tree with siblings, a tree whose
# rows share no siblings, a sequence with no committed context, a one-row sequence at position 0.
SEQS = [(37, 1, None), (20, 4, None), (9, 5, (-1, 0, 0, 1, 2)), (50, 4, (-1, 0, 1, 2)), (0, 3, None), (0, 1, None)]


def rows_of(seqs, pad: int = 2):
    """Row metadata lists (seq, start, end, anc) and each real row's (b, r); `pad` padding rows."""
    from runtime.executor.attention import own_row_bits
    meta, where = [], []
    for b, (start, n, parents) in enumerate(seqs):
        for r, bits in enumerate(own_row_bits(n, parents)):
            meta.append((b, start, start + n, bits))
            where.append((b, r))
    meta += [(0, 0, 0, 0)] * pad
    return meta, where


def reference(q, k, v, table, block_size, meta, scale, group):
    """float64, row by row: the visible positions' cells, softmax over them, per query head."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for t, (b, start, end, bits) in enumerate(meta):
        bits &= (1 << 64) - 1
        pos = [p for p in range(end) if p < start or (bits >> (p - start)) & 1]
        if not pos:
            continue
        cells = torch.tensor([int(table[b, p // block_size]) * block_size + p % block_size for p in pos])
        for h in range(q.shape[1]):
            kk = k[cells, h // group].double()
            s = (kk @ q[t, h].double()) * scale
            out[t, h] = torch.softmax(s, 0) @ v[cells, h // group].double()
    return out


def run_case(device, dtype, nh, nkv, dims, latent=False, splits=None, block_size=16, seqs=SEQS):
    from runtime.ops.kernels.paged_attention import paged_attention
    lengths = [start + n for start, n, _ in seqs]
    k, v, table = ragged_cache(lengths, block_size, nkv, dims, dtype, device, latent=latent)
    meta, _ = rows_of(seqs)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(meta), nh, dims[0], generator=g).to(dtype).to(device)
    cols = [torch.tensor(c, dtype=torch.long, device=device) for c in zip(*meta)]
    scale = dims[0] ** -0.5
    got = paged_attention(q, k, v, table, block_size, *cols, scale=scale, max_keys=max(lengths), num_splits=splits)
    want = reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), block_size, meta, scale, nh // nkv)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    assert not got[-2:].any()   # padding rows: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_grouped_query_heads(dtype):
    run_case(kernel_device(), dtype, nh=4, nkv=2, dims=(16, 16))


def test_rows_one_kv_head_many_query_heads_and_odd_dims():
    run_case(kernel_device(), torch.float32, nh=6, nkv=1, dims=(24, 20), block_size=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_absorbed_rows_over_the_latent_cache(dtype):
    # one latent 'head' [C + Dr], values its first C channels (a view of the keys)
    run_case(kernel_device(), dtype, nh=4, nkv=1, dims=(24, 16), latent=True)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_k_merges_to_the_same_rows(splits):
    run_case(kernel_device(), torch.float32, nh=4, nkv=2, dims=(16, 16), splits=splits)


def test_split_count_from_the_shape_alone():
    kernel_device()
    from runtime.ops.kernels.paged_attention import split_count
    assert split_count(64, 2, 4096) == 1 and split_count(1, 8, 512) == 1
    assert split_count(1, 2, 8192) == 16 and split_count(2, 4, 2048) == 4


def test_too_many_own_rows_is_one_line():
    kernel_device()
    from runtime.executor.attention import own_row_bits
    with pytest.raises(ValueError, match="at most 64"):
        own_row_bits(65, None)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_on_the_gpu(dtype):
    dev = torch.device("cuda", 0)
    run_case(dev, dtype, nh=8, nkv=2, dims=(128, 128))
    run_case(dev, dtype, nh=16, nkv=1, dims=(576, 512), latent=True)
    run_case(dev, dtype, nh=8, nkv=2, dims=(128, 128), splits=4)


@pytest.mark.parametrize("model_name, dtype", [("embedded", "float32"), ("embedded", "bfloat16"),
                                               ("deepseek_plain", "float32")])
def test_static_steps_through_the_kernel_match_the_padded_sdpa(model_name, dtype, family_ckpt):
    """A padded target step (decode, chain and tree rows in one bucket) with its attention through
    the kernel equals the step through the context copy and SDPA: the embedded model (grouped-query
    heads) and a DeepSeek-V3 checkpoint (MLA, absorbed over the latent cache)."""
    kernel_device()
    from pathlib import Path

    from runtime.executor.attention import SeqChunk
    from runtime.executor.runner import ModelRunner
    from runtime.executor.static_step import StepGraphs
    from runtime.model.weights import load_model
    path = (Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe" if model_name == "embedded"
            else family_ckpt(model_name))
    model = load_model(path, dtype, device="cpu")
    assert (model.cache_layout()["latent_dim"] is not None) == (model_name != "embedded")
    runner = ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False)
    prompts = {0: [5, 17, 200, 3, 9], 1: [9, 9, 9, 100, 250, 31, 7, 64, 12], 2: [300, 4, 41, 42, 41, 42, 7]}
    for s, p in prompts.items():
        runner.cache.reserve(s, len(p))
        runner.forward(p, [SeqChunk(s, 0, len(p))])
    chunks = [SeqChunk(0, 5, 1), SeqChunk(1, 9, 3), SeqChunk(2, 7, 4, (-1, 0, 0, 1))]
    for c in chunks:
        runner.cache.reserve(c.seq_id, c.end)
    toks = [11, 12, 13, 14, 15, 16, 17, 18]
    outs = []
    for kernel in (False, True):
        graphs = StepGraphs(model.forward, runner.cache, 512, capture=False, attention_kernel=kernel)
        shape = graphs.shape_of(chunks)
        with torch.inference_mode():
            hidden, plan = graphs.run(toks, chunks, shape)
        assert (plan.rows is not None) == kernel
        outs.append(hidden.float())
    if dtype == "float32":
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    else:   # one rounding of the kernel's float32 softmax against SDPA's bfloat16 steps, over every layer
        assert (outs[1] - outs[0]).abs().max() <= 0.02 * outs[0].abs().max()


def test_eager_steps_through_the_kernel_match_sdpa():
    """Unpadded decode, chain and tree steps (`build_plan`) of a runner whose cache carries the
    kernel equal a runner's without it; a prefill past `KERNEL_MAX_ROWS` rows keeps SDPA."""
    kernel_device()
    from pathlib import Path

    from runtime.executor.attention import KERNEL_MAX_ROWS, SeqChunk, build_plan
    from runtime.executor.runner import ModelRunner
    from runtime.model.weights import load_model
    model = load_model(Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe", "float32", device="cpu")
    runners = [ModelRunner(model, kv_cache_tokens=1024, batch_invariant=False, attention_kernel=on) for on in (False, True)]
    assert runners[0].cache.attention.name != "triton" and runners[1].cache.attention.name == "triton"
    prompts = {0: [5, 17, 200, 3, 9], 1: [9, 9, 9, 100, 250, 31, 7, 64, 12], 2: [300, 4, 41, 42, 41, 42, 7]}
    steps = [([11, 12, 13], [SeqChunk(0, 5, 1), SeqChunk(1, 9, 1), SeqChunk(2, 7, 1)]),
             ([14, 15, 16], [SeqChunk(0, 6, 3)]),
             ([17, 18, 19, 20, 21, 22], [SeqChunk(1, 10, 2), SeqChunk(2, 8, 4, (-1, 0, 0, 2))])]
    got = []
    for runner in runners:
        outs = []
        for s, p in prompts.items():
            runner.cache.reserve(s, len(p))
            with_rows = build_plan(runner.cache, [SeqChunk(s, 0, len(p))]).rows is not None
            assert with_rows == (runner is runners[1] and len(p) <= KERNEL_MAX_ROWS)
            runner.forward(p, [SeqChunk(s, 0, len(p))])
        for toks, chunks in steps:
            for c in chunks:
                runner.cache.reserve(c.seq_id, c.end)
            hidden, plan = runner.forward(toks, chunks)
            assert (plan.rows is not None) == (runner is runners[1])
            outs.append(hidden)
        got.append(torch.cat(outs))
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)
    # the kernel's rows name their device (none of the factories the GPU test forbids)
    from tests.runtime.executor.test_device_placement import DevicelessFactories
    mode = DevicelessFactories()
    with mode:
        assert build_plan(runners[1].cache, steps[2][1]).rows is not None
    assert mode.calls == []
