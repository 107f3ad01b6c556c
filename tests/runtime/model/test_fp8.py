"""Block-scaled FP8 checkpoints: the scheme, (de)quantization, loading whole and as EP shards."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from runtime.model.config import ConfigError, load_config
from runtime.model.quantization import FP8, SCALE_SUFFIX, dequantize, quantization_scheme, quantize, scale_window
from runtime.model.weights import CheckpointError, iter_hf_state, load_model
from tests.runtime.model.test_oracle import our_logits_stepwise
from tools.random_checkpoint import quantize_checkpoint

BLOCK = (16, 24)   # divides none of the small models' widths evenly in both directions: partial blocks


def test_round_trip_error_is_fp8_rounding_and_windows_match_the_whole():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 53, generator=g) * torch.logspace(-3, 1, 53)   # columns of very different scales
    q, s = quantize(w, BLOCK)
    assert q.dtype == FP8 and s.shape == (5, 3) and s.dtype == torch.float32
    back = dequantize(q, s, BLOCK)
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself, or of its block's smallest normal
    bound = w.abs() * 2 ** -4 + s.repeat_interleave(16, 0)[:70].repeat_interleave(24, 1)[:, :53] * 2 ** -9
    assert ((back - w).abs() <= bound).all()
    assert (back - w).abs().max() > 0  # it is a lossy format: the test would see a no-op
    for dim, (start, stop) in ((0, (7, 45)), (1, (5, 50)), (0, (32, 48))):
        lo, hi = scale_window(dim, start, stop, BLOCK)
        if dim == 0:
            part = dequantize(q[start:stop], s[lo:hi], BLOCK, row0=start)
            assert torch.equal(part, back[start:stop])
        else:
            part = dequantize(q[:, start:stop], s[:, lo:hi], BLOCK, col0=start)
            assert torch.equal(part, back[:, start:stop])


def test_all_zero_blocks_and_too_few_scales():
    q, s = quantize(torch.zeros(20, 30), BLOCK)
    assert torch.equal(s, torch.ones(2, 2)) and torch.equal(dequantize(q, s, BLOCK), torch.zeros(20, 30))
    with pytest.raises(ValueError, match="scale blocks"):
        dequantize(q, s[:1], BLOCK)


@pytest.mark.parametrize("q, match", [
    ({"quant_method": "gptq"}, "quant_method='gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8"}, "weight_block_size=None"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "e5m2"),
    ("fp8", "must be an object"),
])
def test_unsupported_schemes_are_refused_naming_the_field(q, match):
    with pytest.raises(ConfigError, match=match):
        quantization_scheme({"quantization_config": q})


def test_scheme_of_a_release_config():
    release = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    scheme = quantization_scheme({"quantization_config": release})
    assert scheme.block == (128, 128) and scheme.describe() == "fp8 blocks 128x128"
    assert quantization_scheme({}) is None


def _fp8_pair(src: Path, tmp: Path) -> tuple[Path, Path]:
    """(an FP8 copy of the checkpoint in `src`, a float32 checkpoint of its dequantized weights)."""
    fp8 = tmp / "fp8"
    shutil.copytree(src, fp8)
    quantize_checkpoint(fp8, BLOCK)
    deq = tmp / "dequantized"
    shutil.copytree(src, deq)
    tensors = load_file(str(fp8 / "model.safetensors"))
    plain = {n: (dequantize(t, tensors[n + SCALE_SUFFIX], BLOCK) if n + SCALE_SUFFIX in tensors else t)
             for n, t in tensors.items() if not n.endswith(SCALE_SUFFIX)}
    save_file(plain, str(deq / "model.safetensors"), metadata={"format": "pt"})
    return fp8, deq


@pytest.mark.parametrize("case", ["glm", "deepseek_yarn", "qwen_norm"])
def test_fp8_checkpoint_gives_the_dequantized_models_logits(request, family_ckpt, case, tmp_path):
    src = request.getfixturevalue("ckpt_mtp") if case == "glm" else family_ckpt(case)
    fp8, deq = _fp8_pair(src, tmp_path)
    a, b = load_model(fp8, "float32", device="cpu"), load_model(deq, "float32", device="cpu")
    assert a.weight_format == "fp8 blocks 16x24 in the checkpoint, dequantized to float32 on load"
    assert b.weight_format == "float32"
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb), na
    ids = torch.randint(0, load_config(src).vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = our_logits_stepwise(a, ids, 8), our_logits_stepwise(b, ids, 8)
    assert want.abs().max() > 0.1
    assert (got - want).abs().max().item() < 1e-5
    # The converted weights take about half the bytes of the same tensors in bfloat16.
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.endswith(SCALE_SUFFIX)]
        fp8_bytes = sum(f.get_tensor(n).nbytes + f.get_tensor(n.removesuffix(SCALE_SUFFIX)).nbytes for n in names)
        bf16_bytes = sum(f.get_tensor(n.removesuffix(SCALE_SUFFIX)).numel() * 2 for n in names)
    assert fp8_bytes / bf16_bytes < 0.56


@pytest.mark.parametrize("case", ["glm", "qwen35_text"])
def test_ep_shards_of_an_fp8_checkpoint_equal_the_dequantized_ones(request, case, tmp_path):
    """Each rank reads only its rows or columns of a weight, and the scale blocks that cover them,
    including windows that start inside a block; Qwen3.5's Gated DeltaNet projection and conv
    read three windows each (the rank's query, key and value channels)."""
    from ep.channel import load_shard_model
    from ep.comm import Communicator
    if case == "glm":
        src = request.getfixturevalue("ckpt_mtp")
    else:
        pytest.importorskip("transformers.models.qwen3_5_moe", reason="transformers without Qwen3.5-MoE")
        src = request.getfixturevalue("family_ckpt")(case)
    fp8, deq = _fp8_pair(src, tmp_path)
    threads = torch.get_num_threads()
    try:
        for rank in range(2):
            comm = Communicator(rank=rank, world_size=2, init_method=None, device="cpu")
            a = load_shard_model(fp8, "float32", comm, "allreduce")
            b = load_shard_model(deq, "float32", comm, "allreduce")
            sa, sb = a.state_dict(), b.state_dict()
            assert sa.keys() == sb.keys()
            if case != "glm":   # its DeltaNet heads split: half the key and value heads on each rank
                la = a.layers[0].linear_attn
                assert (2 * la.nk, 2 * la.nv) == (a.config.linear_num_key_heads, a.config.linear_num_value_heads)
            for name in sa:
                assert torch.equal(sa[name], sb[name]), (rank, name)
    finally:
        torch.set_num_threads(threads)


def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(ckpt_grouped, tmp_path):
    fp8, _ = _fp8_pair(ckpt_grouped, tmp_path)
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = next(n for n in tensors if n.endswith(SCALE_SUFFIX))
    cases = {
        "no_scale": ({k: v for k, v in tensors.items() if k != name}, None, "is FP8 but"),
        "bad_scale": ({**tensors, name: tensors[name][:, :1].contiguous()}, None, "has shape"),
        "orphan_scale": ({**tensors, "model.layers.0.nope.weight" + SCALE_SUFFIX: tensors[name].clone()}, None,
                         "no weight 'model.layers.0.nope.weight'"),
        "no_config": (tensors, "drop", "no quantization_config"),
    }
    for case, (t, cfg_edit, match) in cases.items():
        path = tmp_path / case
        shutil.copytree(fp8, path)
        save_file(t, str(path / "model.safetensors"))
        if cfg_edit == "drop":
            cfg = json.loads((path / "config.json").read_text())
            del cfg["quantization_config"]
            (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=match):
            load_model(path, "float32", device="cpu")


def _kept(model) -> list:
    return [m for m in model.modules() if getattr(m, "fp8", None) is not None]


@pytest.mark.triton
@pytest.mark.parametrize("case", ["glm", "glm5"])
def test_fp8_kept_on_the_device_gives_the_dequantized_models_logits(request, family_ckpt, case, tmp_path):
    """The linears and routed experts keep their FP8 weights and scales (forced on the CPU, the
    kernels under the Triton interpreter): float32 logits within 1e-5 of the dequantized model's,
    those weights in about half the bytes of bfloat16, the checkpoint's own bytes (saved back
    unchanged); kv_b_proj (absorbed into per-head products) dequantized."""
    from tests.runtime.ops.kernel_cases import kernel_device
    kernel_device()
    src = request.getfixturevalue("ckpt_mtp") if case == "glm" else family_ckpt(case)
    fp8, _ = _fp8_pair(src, tmp_path)
    a, b = load_model(fp8, "float32", device="cpu", keep_fp8=True), load_model(fp8, "float32", device="cpu")
    kept = _kept(a)
    assert kept and not _kept(b)
    assert a.weight_format.startswith("fp8 blocks 16x24 in the checkpoint: fp8 e4m3 16x24 kept for ")
    assert a.weight_format.endswith("dequantized to float32 on load") == (case == "glm5")   # kv_b_proj
    experts = [m for m in a.modules() if hasattr(m, "gate_up_proj")]
    assert experts and all(m.fp8 is not None and m.backend.name == "fused-fp8" for m in experts)
    assert all(p.dtype == FP8 for m in kept for n, p in m.named_parameters() if n != "bias")
    if case == "glm5":
        assert all(m.kv_b_proj.fp8 is None for m in a.modules() if hasattr(m, "kv_b_proj"))
    ids = torch.randint(0, load_config(src).vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = our_logits_stepwise(a, ids, 9), our_logits_stepwise(b, ids, 9)   # glm5: more keys than its top 8
    assert want.abs().max() > 0.1
    assert (got - want).abs().max().item() < 1e-5
    fp8_bytes = sum(t.nbytes for m in kept for t in [*m.parameters(), *m.buffers()] if t.dtype in (FP8, torch.float32)
                    and t.dim() > 1)
    bf16_bytes = sum(p.numel() * 2 for m in kept for p in m.parameters() if p.dtype == FP8)
    assert fp8_bytes / bf16_bytes < 0.56
    stored = load_file(str(fp8 / "model.safetensors"))
    saved = dict(iter_hf_state(a))
    for name, t in stored.items():
        if t.dtype == FP8 or name.endswith(SCALE_SUFFIX):
            if name in saved and saved[name].dtype == t.dtype:   # kept (kv_b_proj comes back dequantized)
                assert torch.equal(saved[name].view(torch.uint8) if t.dtype == FP8 else saved[name],
                                   t.view(torch.uint8) if t.dtype == FP8 else t), name


@pytest.mark.triton
def test_fp8_kept_in_bfloat16_is_as_close_as_the_dequantized_weights(ckpt_mtp, tmp_path):
    """bfloat16: the kept model's logits are as close to the float32 ones as the dequantized
    bfloat16 model's (each within bfloat16's rounding of its activations and weights)."""
    from tests.runtime.ops.kernel_cases import kernel_device
    kernel_device()
    fp8, _ = _fp8_pair(ckpt_mtp, tmp_path)
    ids = torch.randint(0, load_config(ckpt_mtp).vocab_size, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    exact = our_logits_stepwise(load_model(fp8, "float32", device="cpu"), ids, 7)
    kept = our_logits_stepwise(load_model(fp8, "bfloat16", device="cpu", keep_fp8=True), ids, 7).float()
    deq = our_logits_stepwise(load_model(fp8, "bfloat16", device="cpu"), ids, 7).float()
    err_kept, err_deq = (kept - exact).abs().max().item(), (deq - exact).abs().max().item()
    assert 0 < err_kept < 2 * err_deq + 1e-3, (err_kept, err_deq)
    assert err_kept < 0.05 * exact.abs().max().item()


@pytest.mark.triton
def test_ep_shards_keep_their_fp8_window_and_the_scale_blocks_covering_it(ckpt_mtp, tmp_path):
    """Each rank's kept linears hold its rows or columns of the stored FP8 weight and the scale
    blocks covering them (windows starting inside a block included): dequantized, they equal the
    dequantizing loader's shard; each rank's row-parallel o_proj through the kernel, partial sums
    added (the all-reduce), gives the whole model's o_proj."""
    from types import SimpleNamespace
    from ep.channel import load_shard_model
    from ep.comm import Communicator
    from tests.runtime.ops.kernel_cases import kernel_device
    kernel_device()
    fp8, _ = _fp8_pair(ckpt_mtp, tmp_path)
    threads = torch.get_num_threads()
    try:
        offsets = set()
        ranks = []
        for rank in range(2):
            comm = Communicator(rank=rank, world_size=2, init_method=None, device="cpu")
            a = dict(load_shard_model(fp8, "float32", comm, "allreduce", keep_fp8=True).named_modules())
            ranks.append(a)
            b = dict(load_shard_model(fp8, "float32", comm, "allreduce").named_modules())
            kept = [n for n, m in a.items() if getattr(m, "fp8", None) is not None]
            assert any(type(a[n]).__name__ == "RowParallelLinear" for n in kept)
            for n in kept:
                m = a[n]
                if hasattr(m, "gate_up_proj"):   # this rank's experts, whole: gate and up blocked apart
                    for e in range(m.num_local_experts):
                        gate, up = m.gate_up_proj[e].chunk(2)
                        got = torch.cat([dequantize(w, s, m.fp8) for w, s in zip((gate, up), m.gate_up_proj_scale_inv[e])])
                        assert torch.equal(got, b[n].gate_up_proj[e]), (rank, n, e)
                        assert torch.equal(dequantize(m.down_proj[e], m.down_proj_scale_inv[e], m.fp8), b[n].down_proj[e])
                    continue
                block, offset = m.fp8
                offsets.add(offset)
                assert torch.equal(dequantize(m.weight, m.weight_scale_inv, block, *offset), b[n].weight), (rank, n)
        assert any(o != (0, 0) for o in offsets)   # some window starts inside a block
        whole = dict(load_model(fp8, "float32", device="cpu").named_modules())
        name = "layers.0.self_attn.o_proj"
        o0, o1 = ranks[0][name], ranks[1][name]
        assert o1.fp8[1] != (0, 0)   # rank 1's columns start inside a block
        x = torch.randn(3, whole[name].in_features, generator=torch.Generator().manual_seed(4))
        w0 = o0.in_features
        other = o1._fp8_matmul(x[:, w0:], None)
        o0.comm = SimpleNamespace(all_reduce=lambda t: t + other)   # rank 1's partial sums, added
        torch.testing.assert_close(o0(x[:, :w0]), whole[name](x), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_keeping_fp8_is_refused_where_the_kernel_cannot_run(ckpt_grouped, tmp_path):
    fp8, _ = _fp8_pair(ckpt_grouped, tmp_path)
    with pytest.raises(ValueError, match="FP8 weights cannot be kept here"):
        load_model(fp8, "float64", device="cpu", keep_fp8=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_is_kept_by_default_on_cuda_and_gives_the_dequantized_logits(ckpt_mtp, family_ckpt, tmp_path, dtype):
    """On CUDA with triton the loader keeps FP8 by itself (the start-up line says so); its logits
    equal those of the same checkpoint dequantized on load (float32 within 1e-4; bfloat16 within a
    few of its roundings over the layers)."""
    for name, src in (("glm", ckpt_mtp), ("glm5", family_ckpt("glm5"))):
        fp8, _ = _fp8_pair(src, tmp_path / name)
        a = load_model(fp8, dtype, device="cuda")
        b = load_model(fp8, dtype, device="cuda", keep_fp8=False)
        assert "kept for" in a.weight_format and _kept(a) and not _kept(b)
        ids = torch.randint(0, load_config(src).vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
        got, want = our_logits_stepwise(a, ids, 9).float(), our_logits_stepwise(b, ids, 9).float()
        tol = 1e-4 if dtype == "float32" else 0.05 * want.abs().max().item()
        assert (got - want).abs().max().item() < tol, name
