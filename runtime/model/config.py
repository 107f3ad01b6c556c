"""Model configuration: a Hugging Face `config.json` read into one frozen dataclass.

Which families are served, and which fields each sets itself, is `runtime.model.families`; this module
reads the fields they share. Both spellings of the rotary settings are accepted: top-level
`rope_theta` / `partial_rotary_factor` (published checkpoints) and the `rope_parameters` dict
that transformers 5 writes (or the older `rope_scaling`). Rotary types: `default` and `yarn`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from runtime.model.families import FAMILIES, family_of

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
ROUTER_SCORINGS = ("sigmoid", "softmax")


class ConfigError(ValueError):
    """A config.json that this runtime cannot serve; the message names the field."""


@dataclass(frozen=True, kw_only=True, slots=True)
class YarnScaling:
    """YaRN rotary scaling (`rope_type: yarn`), as transformers' `_compute_yarn_parameters` reads it."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ConfigError(f"config.json: yarn factor={self.factor} and original_max_position_embeddings="
                              f"{self.original_max_position_embeddings} must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    architecture: str = "Glm4MoeForCausalLM"
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
    router_scoring: str = "sigmoid"      # sigmoid: score-correction bias and grouped top-k; softmax: plain top-k
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    decoder_sparse_step: int = 1         # layer i is MoE when (i + 1) % step == 0 (Qwen3-MoE)
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = False        # rotary on interleaved channel pairs (DeepSeek's layout)
    # Multi-head latent attention (runtime.model.mla) when kv_lora_rank > 0; head_dim is then the rotary part.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek sparse attention (runtime.model.sparse_attention) when index_topk > 0: each layer whose
    # `indexer_types` entry is "full" (the MTP layer always) keeps the top `index_topk` keys by its
    # indexer's scores, a "shared" layer reuses the previous full layer's selection.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()
    index_rope_interleave: bool = False  # the indexer's rotary: GLM-5 interleaved, DeepSeek-V3.2 half-split
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Qwen3.5 / Qwen3.6-MoE: layer_types names each layer "linear_attention" (Gated DeltaNet,
    # runtime.model.linear_attention) or "full_attention"; () is full attention everywhere.
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    attn_output_gate: bool = False       # attention output times sigmoid(a gate the q projection also gives)
    shared_expert_gate: bool = False     # shared expert output times sigmoid(a 1-wide linear of the input)
    shared_expert_intermediate_size: int = 0   # 0: moe_intermediate_size * n_shared_experts
    norm_unit_offset: bool = False       # RMSNorm scales by (1 + weight) (Gemma-style)

    def __post_init__(self) -> None:
        if self.architecture not in FAMILIES:
            raise ConfigError(f"config.json: architecture {self.architecture!r} is not supported; "
                              f"supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "moe_intermediate_size",
                     "num_experts_per_tok", "n_routed_experts", "n_group", "topk_group",
                     "max_position_embeddings", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"config.json: {name}={value!r} must be a whole number")
            if value < 1:
                raise ConfigError(f"config.json: {name}={getattr(self, name)} must be at least 1")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ConfigError(f"config.json: router scoring {self.router_scoring!r}: expected one of "
                              f"{', '.join(ROUTER_SCORINGS)}")
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
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(f"config.json: partial_rotary_factor={self.partial_rotary_factor} gives an odd or "
                              f"empty rotary dimension for head_dim={self.head_dim}")
        if self.is_mla and min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) < 1:
            raise ConfigError(f"config.json: kv_lora_rank={self.kv_lora_rank} needs qk_nope_head_dim, "
                              "qk_rope_head_dim and v_head_dim of at least 1")
        if self.is_sparse:
            if not self.is_mla or self.q_lora_rank is None:
                raise ConfigError(f"config.json: index_topk={self.index_topk} (sparse attention) needs multi-head "
                                  "latent attention with a q_lora_rank")
            if self.index_n_heads < 1 or not self.qk_rope_head_dim <= self.index_head_dim:
                raise ConfigError(f"config.json: index_n_heads={self.index_n_heads} must be at least 1 and "
                                  f"index_head_dim={self.index_head_dim} at least qk_rope_head_dim="
                                  f"{self.qk_rope_head_dim}")
            if (len(self.indexer_types) != self.num_hidden_layers or set(self.indexer_types) - {"full", "shared"}
                    or self.indexer_types[:1] == ("shared",)):
                raise ConfigError(f"config.json: indexer_types={list(self.indexer_types)} must give 'full' or "
                                  f"'shared' for each of the {self.num_hidden_layers} layers, the first 'full'")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ConfigError(f"config.json: q_lora_rank={self.q_lora_rank} must be at least 1 or null")
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(f"config.json: num_nextn_predict_layers={self.num_nextn_predict_layers}; "
                              "this runtime supports 0 or 1")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers or \
                    set(self.layer_types) - {"linear_attention", "full_attention"}:
                raise ConfigError(f"config.json: layer_types must give 'linear_attention' or 'full_attention' "
                                  f"for each of the {self.num_hidden_layers} layers")
            if "full_attention" not in self.layer_types:
                raise ConfigError("config.json: layer_types has no full_attention layer")
        if self.linear_layers and (min(self.linear_conv_kernel_dim, self.linear_key_head_dim, self.linear_value_head_dim,
                                       self.linear_num_key_heads, self.linear_num_value_heads) < 1
                                   or self.linear_num_value_heads % self.linear_num_key_heads):
            raise ConfigError("config.json: linear attention needs positive linear_* sizes and "
                              "linear_num_value_heads a multiple of linear_num_key_heads")
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ConfigError(f"config.json: eos_token_id={t} is outside the vocabulary of {self.vocab_size}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mtp_normed_hidden(self) -> bool:
        """Whether the MTP layer reads hiddens after a final norm (Qwen3.5's `mtp.*`, as vLLM and
        SGLang run Qwen3-Next / Qwen3.5 MTP): the target's after `norm`, its own after `mtp.norm`;
        else the pre-norm hiddens (the other families)."""
        return bool(self.layer_types)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The linear-attention layers (a recurrent state per sequence, no KV cache)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear-attention layer's conv1d: queries, keys and values."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash) rather than grouped-query."""
        return self.kv_lora_rank > 0

    @property
    def is_sparse(self) -> bool:
        """DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): an indexer beside the MLA."""
        return self.index_topk > 0

    def has_indexer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` runs its own indexer: a "full" layer, or the MTP layer."""
        return self.is_sparse and (layer_idx >= self.num_hidden_layers or self.indexer_types[layer_idx] == "full")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Layers from `first_k_dense_replace` on are MoE (the MTP layer, at index num_hidden_layers,
        too), except those in `mlp_only_layers` and, with `decoder_sparse_step` s, those with
        (index + 1) not a multiple of s."""
        return (layer_idx >= self.first_k_dense_replace and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def kv_values_per_token(self, *, compressed: bool = True) -> int:
        """Values a token keeps in the KV cache per cache layer: the latent plus the rotary key for
        multi-head latent attention (`compressed=False`: the per-head keys and values it expands
        to), keys and values of every KV head otherwise."""
        if self.is_mla and compressed:   # plus the indexer's key under sparse attention
            return self.kv_lora_rank + self.qk_rope_head_dim + self.index_head_dim * self.is_sparse
        if self.is_mla:
            return self.num_attention_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def num_attention_layers(self) -> int:
        """Target layers with a KV cache plane: all but the linear-attention ones."""
        return self.num_hidden_layers - len(self.linear_layers)

    @property
    def num_cache_layers(self) -> int:
        """Attention layers plus the MTP layer: the KV cache holds one plane per layer."""
        return self.num_attention_layers + self.num_nextn_predict_layers

    def cache_index(self, layer_idx: int) -> int:
        """The KV cache plane of attention layer `layer_idx` (the MTP layer's: num_hidden_layers):
        the linear-attention layers before it have none."""
        return layer_idx - sum(1 for i in self.linear_layers if i < layer_idx)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that transformers reads back as the same model (GLM-4.5 MoE only)."""
        if self.architecture != "Glm4MoeForCausalLM":
            raise ConfigError(f"to_hf_dict writes Glm4MoeForCausalLM configs only, not {self.architecture}")
        out: dict[str, Any] = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                               "hidden_act": "silu"}
        glm = {f.name for f in fields(self)} - set(_NOT_GLM)
        for f in fields(self):
            if f.name in glm and f.name not in ("eos_token_ids", "rope_theta", "partial_rotary_factor"):
                out[f.name] = getattr(self, f.name)
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                  "partial_rotary_factor": self.partial_rotary_factor}
        out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        try:
            family = family_of(raw)
            if family.text_config and isinstance(raw.get("text_config"), dict):
                # A multimodal checkpoint: the text model's fields, under the outer architecture.
                raw = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
            own = family.read(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        merged = {**raw, **own}
        for name in (*_REQUIRED, "n_routed_experts", "num_key_value_heads"):
            if merged.get(name) is None:
                raise ConfigError(f"{source}: missing field {name!r}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (expected 'silu')")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"{source}: rope_type={rope_type!r} is not supported (expected 'default' or 'yarn')")
        rope_theta = raw.get("rope_theta", rope.get("rope_theta"))
        if rope_theta is None:
            raise ConfigError(f"{source}: missing field 'rope_theta' (top level or in rope_parameters)")
        scaling = None
        if rope_type == "yarn":
            if rope.get("factor") is None:
                raise ConfigError(f"{source}: rope_type 'yarn' needs a 'factor'")
            scaling = YarnScaling(
                factor=float(rope["factor"]), beta_fast=float(rope.get("beta_fast") or 32),
                beta_slow=float(rope.get("beta_slow") or 1), mscale=rope.get("mscale"),
                mscale_all_dim=rope.get("mscale_all_dim"), attention_factor=rope.get("attention_factor"),
                original_max_position_embeddings=int(rope.get("original_max_position_embeddings")
                                                     or merged.get("max_position_embeddings", 4096)),
                truncate=bool(rope.get("truncate", True)))
        partial = merged.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        known = {f.name for f in fields(cls)}
        kwargs = {k: merged[k] for k in known if k in merged and merged[k] is not None
                  and k not in ("eos_token_ids", "rope_theta", "partial_rotary_factor", "head_dim",
                                "architecture", "rope_scaling", "mlp_only_layers", "indexer_types", "layer_types")}
        head_dim = merged.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        try:
            return cls(**kwargs, architecture=family.architecture, head_dim=int(head_dim),
                       rope_theta=float(rope_theta), partial_rotary_factor=float(partial), rope_scaling=scaling,
                       mlp_only_layers=tuple(merged.get("mlp_only_layers") or ()), eos_token_ids=eos_ids,
                       indexer_types=tuple(merged.get("indexer_types") or ()),
                       # Only a family that reads them has linear-attention layer types (GLM-5's
                       # config.json names its own "indexed_attention" layers, which mean nothing here).
                       layer_types=tuple(own.get("layer_types") or ()))
        except TypeError as exc:  # a field of the wrong JSON type
            raise ConfigError(f"{source}: {exc}") from None


# Fields the GLM-4.5 MoE config.json does not carry (to_hf_dict leaves them out).
_NOT_GLM = ("architecture", "router_scoring", "decoder_sparse_step", "mlp_only_layers", "o_proj_bias",
            "rope_scaling", "rope_interleave", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads", "index_head_dim", "indexer_types",
            "index_rope_interleave",
            "layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
            "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "attn_output_gate",
            "shared_expert_gate", "shared_expert_intermediate_size", "norm_unit_offset")


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


BEHAVIOR_DTYPES = ("float32", "bfloat16", "float64")


def load_behavior(model_dir: str | Path, dtype: str | None = None) -> dict[str, Any]:
    """The `[behavior]` table of the model folder's optional `metrale.toml` ({} when absent), with
    the values of its `[behavior.<dtype>]` table, when `dtype` is given and the folder has one,
    over the shared ones (a step's costs, and so the best speculation depth by width, differ by
    dtype). A dtype table must name a dtype Metrale serves and hold only values."""
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
    shared = {k: v for k, v in behavior.items() if not isinstance(v, dict)}
    for name, table in behavior.items():
        if isinstance(table, dict):
            if name not in BEHAVIOR_DTYPES:
                raise ConfigError(f"{path}: [behavior.{name}] is not a dtype table (one of {', '.join(BEHAVIOR_DTYPES)})")
            nested = next((k for k, v in table.items() if isinstance(v, dict)), None)
            if nested is not None:
                raise ConfigError(f"{path}: [behavior.{name}.{nested}]: a dtype table holds values, not tables")
    if dtype is not None and isinstance(behavior.get(dtype), dict):
        shared.update(behavior[dtype])
    return shared
