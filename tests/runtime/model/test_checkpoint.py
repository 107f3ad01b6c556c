"""Config parsing and checkpoint loading: both rotary spellings, sharded files, named errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.model.config import ConfigError, ModelConfig, load_config
from runtime.model.weights import CheckpointError, iter_hf_state, load_model

RAW = {"model_type": "glm4_moe", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 16,
       "num_experts_per_tok": 2, "n_routed_experts": 4}


def test_both_rotary_spellings_give_the_same_config():
    top = ModelConfig.from_hf_dict({**RAW, "rope_theta": 5e5, "partial_rotary_factor": 0.25})
    nested = ModelConfig.from_hf_dict({**RAW, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                                 "partial_rotary_factor": 0.25}})
    assert top == nested
    assert top.rope_theta == 5e5 and top.rotary_dim == 2 and top.head_dim == 8


@pytest.mark.parametrize("raw, match", [
    ({**RAW, "model_type": "llama", "rope_theta": 1e4}, "model_type='llama'"),
    ({k: v for k, v in RAW.items() if k != "n_routed_experts"} | {"rope_theta": 1e4}, "n_routed_experts"),
    (RAW, "rope_theta"),
    ({**RAW, "rope_theta": 1e4, "num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({**RAW, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "llama3"),
    ({**RAW, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "yarn.*factor"),
])
def test_bad_configs_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(raw)


def test_missing_folder_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path)


def test_sharded_checkpoint_loads_like_one_file(ckpt_grouped, tmp_path):
    tensors = load_file(str(ckpt_grouped / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    out = tmp_path / "sharded"
    out.mkdir()
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / fname))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    shutil.copy(ckpt_grouped / "config.json", out / "config.json")
    a, b = load_model(ckpt_grouped, "float64", device="cpu"), load_model(out, "float64", device="cpu")
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)


def test_round_trip_names(ckpt_grouped):
    model = load_model(ckpt_grouped, "float32", device="cpu")
    ours = dict(iter_hf_state(model))
    theirs = load_file(str(ckpt_grouped / "model.safetensors"))
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k].float(), theirs[k].float()) for k in theirs)


def _rewrite(src, dst, edit):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_missing_tensor_is_named(ckpt_plain, tmp_path):
    path = _rewrite(ckpt_plain, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"expert\(s\) \[3\]"):
        load_model(path, device="cpu")
    path = _rewrite(ckpt_plain, tmp_path / "m2", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="norm.weight"):
        load_model(path, device="cpu")


def test_unexpected_or_misshapen_tensor_is_named(ckpt_plain, tmp_path):
    path = _rewrite(ckpt_plain, tmp_path / "u", lambda t: t.update({"model.layers.0.mystery.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match="mystery"):
        load_model(path, device="cpu")
    path = _rewrite(ckpt_plain, tmp_path / "s",
                    lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*\(7,\)"):
        load_model(path, device="cpu")


def test_mtp_layer_loads_into_its_own_module(ckpt_plain, tmp_path):
    """MTP tensors at index num_hidden_layers go to `model.mtp`; transformers would drop them."""
    cfg = json.loads((ckpt_plain / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    h = cfg["hidden_size"]

    def add_mtp(t):
        src = f"model.layers.{layers - 1}."
        for k in [k for k in t if k.startswith(src)]:
            t[f"model.layers.{layers}." + k[len(src):]] = t[k].clone() + 0.5
        t[f"model.layers.{layers}.enorm.weight"] = torch.full((h,), 2.0)
        t[f"model.layers.{layers}.hnorm.weight"] = torch.ones(h)
        t[f"model.layers.{layers}.eh_proj.weight"] = torch.randn(h, 2 * h)
        t[f"model.layers.{layers}.shared_head.norm.weight"] = torch.ones(h)

    path = _rewrite(ckpt_plain, tmp_path / "mtp", add_mtp)
    model = load_model(path, "float32", device="cpu")
    assert model.mtp is not None and model.mtp.shared_head.head is None  # falls back to lm_head
    assert torch.equal(model.mtp.enorm.weight, torch.full((h,), 2.0))
    src = load_file(str(path / "model.safetensors"))
    assert torch.equal(model.mtp.block.mlp.experts.down_proj[5], src[f"model.layers.{layers}.mlp.experts.5.down_proj.weight"])
    base = load_model(ckpt_plain, "float32", device="cpu")
    assert base.mtp is None  # config announces one MTP layer, the checkpoint has none
