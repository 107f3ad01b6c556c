"""Model configuration: a Hugging Face `config.json` of `model_type: glm4_moe` read into one frozen dataclass.

Both spellings of the rotary settings are accepted: top-level `rope_theta` / `partial_rotary_factor`
(published GLM-4.5 checkpoints) and the `rope_parameters` dict that transformers 5 writes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("glm4_moe",)

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "n_routed_experts",
)


class ConfigError(ValueError):
    """A config.json that this runtime cannot serve; the message names the field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "moe_intermediate_size",
                     "num_experts_per_tok", "n_routed_experts", "n_group", "topk_group",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.json: {name}={getattr(self, name)} must be at least 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads={self.num_key_value_heads}")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"config.json: n_routed_experts={self.n_routed_experts} is not a multiple "
                              f"of n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"config.json: topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"n_routed_experts={self.n_routed_experts}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ConfigError(f"config.json: partial_rotary_factor={self.partial_rotary_factor} gives an odd or "
                              f"empty rotary dimension for head_dim={self.head_dim}")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(f"config.json: num_nextn_predict_layers={self.num_nextn_predict_layers}; "
                              "this runtime supports 0 or 1")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ConfigError(f"config.json: eos_token_id={t} is outside the vocabulary of {self.vocab_size}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers from `first_k_dense_replace` on are MoE (the MTP layer, at index num_hidden_layers, too)."""
        return layer_idx >= self.first_k_dense_replace

    @property
    def num_cache_layers(self) -> int:
        """Target layers plus the MTP layer: the KV cache holds one plane per layer."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers reads back as the same model."""
        out: dict[str, Any] = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                               "hidden_act": "silu"}
        for f in fields(self):
            if f.name in ("eos_token_ids", "rope_theta", "partial_rotary_factor"):
                continue
            out[f.name] = getattr(self, f.name)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor}
        out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type={model_type!r} is not supported (expected one of "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        for name in _REQUIRED:
            if name not in raw or raw[name] is None:
                raise ConfigError(f"{source}: missing field {name!r}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (expected 'silu')")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: rope_type={rope_type!r} is not supported (expected 'default')")
        rope_theta = raw.get("rope_theta", rope.get("rope_theta"))
        if rope_theta is None:
            raise ConfigError(f"{source}: missing field 'rope_theta' (top level or in rope_parameters)")
        partial = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        known = {f.name for f in fields(cls)}
        kwargs = {k: raw[k] for k in known if k in raw and raw[k] is not None
                  and k not in ("eos_token_ids", "rope_theta", "partial_rotary_factor", "head_dim")}
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        try:
            return cls(**kwargs, head_dim=int(head_dim), rope_theta=float(rope_theta),
                       partial_rotary_factor=float(partial), eos_token_ids=eos_ids)
        except TypeError as exc:  # a field of the wrong JSON type
            raise ConfigError(f"{source}: {exc}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `config.json` (and the EOS ids of `generation_config.json`, which win) from a model folder."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {str(model_dir)!r} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a model folder needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        if gen.get("eos_token_id") is not None:
            raw = {**raw, "eos_token_id": gen["eos_token_id"]}
    return ModelConfig.from_hf_dict(raw, source=str(path))


def load_behavior(model_dir: str | Path) -> dict[str, Any]:
    """The `[behavior]` table of the model folder's optional `metrale.toml` ({} when absent)."""
    import tomllib
    path = Path(model_dir) / "metrale.toml"
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    behavior = data.get("behavior", {})
    if not isinstance(behavior, dict):
        raise ConfigError(f"{path}: [behavior] must be a table")
    return behavior
