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
from runtime.model.weights import CheckpointError, load_model
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
