"""Write a random checkpoint of one served family with transformers' own `save_pretrained` (tests,
speed comparisons), with an MTP layer after the last decoder layer where the family has one.

    python tools/random_checkpoint.py OUT_DIR --tokenizer models/tiny-glm-moe/tokenizer.json \
        [--family glm4_moe|qwen3_moe|deepseek_v3|glm4_moe_lite|glm_moe_dsa|deepseek_v32] [--hidden 256 --layers 6 --experts 8]
        [--fp8 [--fp8-block 128,128]]

`--fp8` stores it as the FP8 releases do: every linear weight of the decoder layers (and the MTP
layer's) in float8_e4m3fn with a float32 `weight_scale_inv` per block, and config.json's
`quantization_config` saying so; embeddings, the head, norms and routers stay as they were.

transformers does not build the MTP layer (it drops those tensors on load), so it is added to the
saved file: a copy of the last decoder layer at index num_hidden_layers, `eh_proj` passing the
target hidden through (plus noise), unit norms; drafts then agree with the target often enough for
verification to accept some and reject others.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

# transformers config class, model class, options of a small config of that family ({h}: hidden size)
FAMILIES = {
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", True),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", True),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", True),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", True),
    # Qwen3.5 / Qwen3.6-MoE: the text-only layout and the multimodal one (a small vision tower beside).
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", True),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", True),
}


def family_config(family: str, hidden: int, layers: int, experts: int) -> dict[str, Any]:
    """transformers config keywords of a small model of `family` (heads of hidden/4 channels)."""
    common = dict(hidden_size=hidden, intermediate_size=3 * hidden // 2, num_hidden_layers=layers,
                  num_attention_heads=4, moe_intermediate_size=hidden // 2, num_experts_per_tok=2,
                  max_position_embeddings=2048, eos_token_id=0, bos_token_id=None)
    if family == "glm4_moe":
        return {**common, "num_key_value_heads": 2, "head_dim": hidden // 4, "n_routed_experts": experts,
                "n_shared_experts": 1, "first_k_dense_replace": 1}
    if family == "qwen3_moe":
        return {**common, "num_key_value_heads": 2, "head_dim": hidden // 4, "num_experts": experts,
                "norm_topk_prob": True}
    if family.startswith("qwen3_5_moe"):   # every 4th layer full attention, the rest Gated DeltaNet
        text = {**common, "num_key_value_heads": 2, "head_dim": hidden // 4, "num_experts": experts,
                "shared_expert_intermediate_size": hidden // 2, "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": hidden // 4, "linear_value_head_dim": hidden // 4,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [1, 1, 0]}}
        del text["intermediate_size"]
        if family == "qwen3_5_moe_text":
            return text
        return {"text_config": text, "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                                       "num_heads": 2, "out_hidden_size": hidden}}
    mla = dict(num_key_value_heads=4, n_routed_experts=experts, n_shared_experts=1, kv_lora_rank=hidden // 2,
               q_lora_rank=3 * hidden // 4, qk_nope_head_dim=hidden // 4, qk_rope_head_dim=hidden // 8,
               v_head_dim=hidden // 4)
    if family == "deepseek_v3":
        return {**common, **mla, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 1.0}}
    if family in ("glm_moe_dsa", "deepseek_v32"):   # sparse attention: an indexer of 16 heads, top 8 keys
        return {**common, **mla, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "index_topk": 8,
                "index_n_heads": 16, "index_head_dim": hidden // 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return {**common, **mla}


def add_qwen35_mtp_layer(path: Path, seed: int = 5) -> Path:
    """Qwen3.5's `mtp.*` layer: `mtp.layers.0` a copy of the last full-attention layer, `mtp.fc`
    passing the target hidden through (plus noise), unit (zero, as 1 + w) norms; config.json's
    `mtp_num_hidden_layers` 1."""
    from safetensors.torch import load_file, save_file
    raw = json.loads((path / "config.json").read_text())
    cfg = raw.get("text_config", raw)
    h, full = cfg["hidden_size"], max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    tensors = load_file(str(path / "model.safetensors"))
    src = next(p for p in ("model.language_model.", "model.") if f"{p}layers.0.input_layernorm.weight" in tensors)
    src += f"layers.{full}."
    for k in [k for k in tensors if k.startswith(src)]:
        tensors["mtp.layers.0." + k[len(src):]] = tensors[k].clone()
    g = torch.Generator().manual_seed(seed)
    fc = torch.zeros(h, 2 * h)
    fc[:, h:] = torch.eye(h)
    tensors["mtp.fc.weight"] = fc + 0.02 * torch.randn(h, 2 * h, generator=g)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.zeros(h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def add_mtp_layer(path: Path, seed: int = 5, noise: float = 0.0) -> Path:
    """Append an MTP layer at index num_hidden_layers to the checkpoint in `path`: the last decoder
    layer's tensors (plus `noise`), eh_proj passing the target hidden through, unit norms."""
    from safetensors.torch import load_file, save_file
    cfg = json.loads((path / "config.json").read_text())
    if "linear_attention" in cfg.get("text_config", cfg).get("layer_types", ()):   # Qwen3.5's hybrid layers
        return add_qwen35_mtp_layer(path, seed)
    layers, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    src = f"model.layers.{layers - 1}."
    for k in [k for k in tensors if k.startswith(src)]:
        extra = noise * torch.randn(tensors[k].shape, generator=g).to(tensors[k].dtype) if noise else 0.0
        tensors[f"model.layers.{layers}." + k[len(src):]] = tensors[k].clone() + extra
    eh = torch.zeros(h, 2 * h)
    eh[:, h:] = torch.eye(h)  # pass the target hidden through, ignore the token
    eh += 0.02 * torch.randn(h, 2 * h, generator=g)
    tensors[f"model.layers.{layers}.eh_proj.weight"] = eh
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{layers}.{name}.weight"] = torch.ones(h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if "num_nextn_predict_layers" not in cfg:
        (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}, indent=2))
    return path


def write_checkpoint(out: Path, family: str, config: dict[str, Any], *, seed: int = 0, mtp: bool = False,
                     weight_std: float | None = None, dtype: torch.dtype | None = None) -> Path:
    """Save a random transformers model of `family` with `config` to `out` (an MTP layer when
    `mtp`). `weight_std`: every matrix redrawn with this deviation (larger logits than the
    default init) and the routers' correction biases made non-zero, so routing matters.
    `dtype`: the stored dtype (default float32; bfloat16 halves a large checkpoint)."""
    import transformers
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    config_cls, model_cls, has_mtp = FAMILIES[family]
    if mtp and not has_mtp:
        raise ValueError(f"family {family!r} has no MTP layer")
    if "text_config" in config:   # a multimodal config: the text model's keys given beside it go inside
        config = {"text_config": {**config["text_config"], **{k: v for k, v in config.items()
                                                              if k not in ("text_config", "vision_config")}},
                  "vision_config": config.get("vision_config")}
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    if weight_std is not None:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.05)
            for n, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, weight_std)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out)
    return add_mtp_layer(out) if mtp else out


# Stored in their own dtype by the FP8 releases (and here): embeddings, heads, routers, norms (1-D).
_NOT_FP8 = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "mlp.gate.weight")


def quantize_checkpoint(path: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Rewrite the checkpoint in `path` as a block-scaled FP8 one (see the module docstring)."""
    from safetensors.torch import load_file, save_file
    from runtime.model.quantization import SCALE_SUFFIX, quantize
    tensors = load_file(str(path / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    kept: list[str] = []
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith(".weight") and not name.endswith(_NOT_FP8):
            out[name], out[name + SCALE_SUFFIX] = quantize(t, block)
        else:
            out[name] = t
            if t.dim() == 2:
                kept.append(name.removesuffix(".weight"))
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": sorted(kept)}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json whose vocabulary the model uses")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="glm4_moe")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer of families that have one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true", help="store linear weights as block-scaled FP8 (as the released "
                    "DeepSeek-V3 / GLM-5 / Qwen3.5 checkpoints are)")
    ap.add_argument("--fp8-block", default="128,128", help="rows,columns of one FP8 scale block (default: 128,128)")
    args = ap.parse_args()
    try:
        block = tuple(int(v) for v in args.fp8_block.split(","))
    except ValueError:
        block = ()
    if len(block) != 2 or min(block) < 1:
        ap.error(f"--fp8-block {args.fp8_block!r}: expected two positive whole numbers, e.g. 128,128")
    if args.hidden < 16 or args.hidden % 16:
        ap.error(f"--hidden {args.hidden}: expected a multiple of 16")
    vocab = len(json.loads(args.tokenizer.read_text())["model"]["vocab"])
    config = {**family_config(args.family, args.hidden, args.layers, args.experts), "vocab_size": vocab}
    mtp = FAMILIES[args.family][2] and not args.no_mtp
    write_checkpoint(args.out, args.family, config, seed=args.seed, mtp=mtp)
    if args.fp8:
        quantize_checkpoint(args.out, block)
    shutil.copy(args.tokenizer, args.out / "tokenizer.json")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
