"""The model registry: which checkpoint families this runtime serves and what each adds.

Every family is built from the same blocks (runtime.model.layers, runtime.model.mla, runtime.model.rotary); a
family only reads the `config.json` fields in which it differs into `ModelConfig` keywords:

| architecture | attention | router | MLP pattern | MTP layer |
|---|---|---|---|---|
| Glm4MoeForCausalLM | GQA, partial rotary, optional q/k norm | sigmoid, grouped | first_k_dense_replace | optional |
| Qwen3MoeForCausalLM | GQA, q/k norm | softmax top-k | decoder_sparse_step, mlp_only_layers | none |
| DeepseekV3ForCausalLM | MLA, YaRN | sigmoid, grouped | first_k_dense_replace | optional |
| Glm4MoeLiteForCausalLM | MLA | sigmoid, grouped | mlp_layer_types | optional |
| GlmMoeDsaForCausalLM (GLM-5) | MLA + sparse (indexer_types, interleaved indexer rotary) | sigmoid, grouped | mlp_layer_types | optional |
| DeepseekV32ForCausalLM | MLA + sparse (half-split indexer rotary) | sigmoid, grouped | mlp_layer_types | optional |
| Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM | Gated DeltaNet + gated GQA (layer_types) | softmax top-k, gated shared expert | all MoE | `mtp.*` |

Qwen3.5 / Qwen3.6-MoE's multimodal layout keeps the text model's fields under `text_config`
(`text_config=True`: read from there) and its tensors under `model.language_model.*`.

A checkpoint is matched by its `architectures` list first, then by `model_type`. This module
imports nothing of the project: `runtime.model.config` turns what it returns into a `ModelConfig`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Raw = dict[str, Any]


class UnknownArchitecture(ValueError):
    """A config.json naming no architecture this runtime serves."""


@dataclass(frozen=True, slots=True)
class Family:
    architecture: str
    model_type: str
    read: Callable[[Raw], Raw]   # config.json -> the ModelConfig keywords this family sets itself
    text_config: bool = False    # the fields live under config.json's `text_config` (a multimodal layout)


def _glm4_moe(raw: Raw) -> Raw:
    return {"router_scoring": "sigmoid"}


def _qwen3_moe(raw: Raw) -> Raw:
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise ValueError("missing field 'num_experts'")
    return {"router_scoring": "softmax", "n_routed_experts": experts, "n_shared_experts": 0,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)), "use_qk_norm": True,
            "o_proj_bias": bool(raw.get("attention_bias", False)), "num_nextn_predict_layers": 0,
            "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(raw.get("mlp_only_layers") or ()), "partial_rotary_factor": 1.0}


def _qwen3_5_moe(raw: Raw) -> Raw:
    """Qwen3.5 / Qwen3.6-MoE: Gated DeltaNet linear attention in most layers, gated attention with
    q/k norm in the rest, every layer MoE with a sigmoid-gated shared expert, (1 + w) norms."""
    for name in ("num_experts", "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size"):
        if raw.get(name) is None:
            raise ValueError(f"missing field {name!r}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    types = raw.get("layer_types") or ["linear_attention" if (i + 1) % int(raw.get("full_attention_interval", 4))
                                       else "full_attention" for i in range(raw["num_hidden_layers"])]
    return {"router_scoring": "softmax", "n_routed_experts": raw["num_experts"], "n_shared_experts": 1,
            "shared_expert_intermediate_size": raw["shared_expert_intermediate_size"], "shared_expert_gate": True,
            "intermediate_size": raw["shared_expert_intermediate_size"], "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 1.0, "first_k_dense_replace": 0, "norm_topk_prob": True, "use_qk_norm": True,
            "o_proj_bias": bool(raw.get("attention_bias", False)), "attn_output_gate": True,
            "norm_unit_offset": True, "layer_types": tuple(types),
            # The `mtp.*` layer (fc, pre_fc_norm_embedding / _hidden, layers.0, norm): runtime.model.weights maps it.
            "num_nextn_predict_layers": int(raw.get("mtp_num_hidden_layers") or 0),
            "partial_rotary_factor": float(raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25)))}


def _mla(raw: Raw) -> Raw:
    """The multi-head latent attention fields shared by DeepSeek-V3 and GLM-4.7-Flash."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not raw.get(name):
            raise ValueError(f"missing field {name!r}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return {"router_scoring": "sigmoid", "kv_lora_rank": raw["kv_lora_rank"], "q_lora_rank": raw.get("q_lora_rank"),
            "qk_nope_head_dim": raw["qk_nope_head_dim"], "qk_rope_head_dim": raw["qk_rope_head_dim"],
            "v_head_dim": raw["v_head_dim"], "rope_interleave": bool(raw.get("rope_interleave", True)),
            "head_dim": raw["qk_rope_head_dim"], "o_proj_bias": bool(raw.get("attention_bias", False)),
            "partial_rotary_factor": float(raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
            "num_key_value_heads": raw.get("num_key_value_heads") or raw["num_attention_heads"]}


def _deepseek_v3(raw: Raw) -> Raw:
    return {**_mla(raw), "first_k_dense_replace": int(raw.get("first_k_dense_replace", 0))}


def _glm4_moe_lite(raw: Raw, dense_default: int = 1) -> Raw:
    out = _mla(raw)
    types = raw.get("mlp_layer_types")
    if types is None:
        return {**out, "first_k_dense_replace": int(raw.get("first_k_dense_replace", dense_default))}
    if len(types) != raw["num_hidden_layers"] or set(types) - {"dense", "sparse"}:
        raise ValueError(f"mlp_layer_types={types} must give 'dense' or 'sparse' for each of the "
                         f"{raw['num_hidden_layers']} layers")
    return {**out, "first_k_dense_replace": 0,
            "mlp_only_layers": tuple(i for i, t in enumerate(types) if t == "dense")}


def _indexer_types(raw: Raw) -> list[str]:
    """GLM-5's per-layer indexer kinds: `indexer_types`, else transformers' `index_topk_pattern`
    ("F"/"S" per layer), else its `index_topk_freq` / `index_skip_topk_offset` schedule."""
    if raw.get("indexer_types") is not None:
        return list(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        table = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and set(pattern) - set(table):
            raise ValueError(f"index_topk_pattern={pattern!r} must be letters F and S")
        return [table[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(raw.get("index_topk_freq", 1)), 1), int(raw.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(raw["num_hidden_layers"])]


def _sparse(raw: Raw, interleave: bool, types: list[str]) -> Raw:
    """DeepSeek sparse attention (runtime.model.sparse_attention) over the MLA fields."""
    out = {**_glm4_moe_lite(raw, dense_default=3), "rope_interleave": True}
    for name, default in (("index_topk", 2048), ("index_head_dim", 128), ("index_n_heads", 32)):
        value = raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number of at least 1")
        out[name] = value
    return {**out, "indexer_types": tuple(types), "index_rope_interleave": interleave}


def _glm_moe_dsa(raw: Raw) -> Raw:
    return _sparse(raw, True, _indexer_types(raw))


def _deepseek_v32(raw: Raw) -> Raw:
    return _sparse({"index_n_heads": 64, **raw}, False, ["full"] * raw["num_hidden_layers"])


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("Glm4MoeForCausalLM", "glm4_moe", _glm4_moe),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", _qwen3_moe),
    Family("DeepseekV3ForCausalLM", "deepseek_v3", _deepseek_v3),
    Family("Glm4MoeLiteForCausalLM", "glm4_moe_lite", _glm4_moe_lite),
    Family("GlmMoeDsaForCausalLM", "glm_moe_dsa", _glm_moe_dsa),
    Family("DeepseekV32ForCausalLM", "deepseek_v32", _deepseek_v32),
    Family("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", _qwen3_5_moe, text_config=True),
    Family("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", _qwen3_5_moe),
)}


def family_of(raw: Raw) -> Family:
    """The family of a config.json: by `architectures`, else by `model_type`; anything else is
    refused naming it and the supported architectures."""
    for arch in raw.get("architectures") or ():
        if arch in FAMILIES:
            return FAMILIES[arch]
    for family in FAMILIES.values():
        if raw.get("model_type") == family.model_type:
            return family
    named = raw.get("architectures") or raw.get("model_type")
    raise UnknownArchitecture(f"architecture {named!r} (model_type={raw.get('model_type')!r}) is not supported; "
                              f"supported: {', '.join(FAMILIES)}")
