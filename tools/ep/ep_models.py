"""Published shapes and GPU figures for `tools/ep/ep_sim.py`, each with its source.

Models: the fields of each release's config.json that the cost of a decode step depends on.
GPUs: the vendor datasheet's dense (not 2:4 sparse) FLOP/s, HBM bandwidth and capacity, NVLink
bandwidth per direction (the datasheets give both directions summed) and the RDMA NIC per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Attention:
    heads: int
    # multi-head latent attention (DeepSeek-V3, GLM-5)
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    # DeepSeek sparse attention (GLM-5): attend over index_topk tokens an FP8 indexer picks
    index_topk: int = 0
    index_heads: int = 0
    index_dim: int = 0
    # grouped-query attention with an output gate (Qwen3.5's full-attention layers)
    kv_heads: int = 0
    head_dim: int = 0
    gated: bool = False
    # Gated DeltaNet (Qwen3.5's linear-attention layers)
    linear_v_heads: int = 0
    linear_k_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    name: str
    source: str
    hidden: int
    vocab: int
    dense_intermediate: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    num_groups: int
    attention: Attention
    layers: tuple[tuple[str, bool], ...]     # (token mixer: mla / gqa / gdn, is MoE) per decoder layer
    weight_bytes: int = 1                    # FP8 linear weights (block scales ignored); LM head BF16


def _stack(num_dense: int, num_layers: int, mixer: str = "mla") -> tuple[tuple[str, bool], ...]:
    return tuple((mixer, i >= num_dense) for i in range(num_layers))


MODELS: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(
        # huggingface.co/deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, intermediate_size 18432,
        # moe_intermediate_size 2048, num_hidden_layers 61, first_k_dense_replace 3, n_routed_experts 256,
        # n_shared_experts 1, num_experts_per_tok 8, n_group 8, num_attention_heads 128, q_lora_rank 1536,
        # kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, vocab_size 129280;
        # quantization_config fp8 (128x128 blocks).
        name="deepseek-v3", source="huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
        hidden=7168, vocab=129280, dense_intermediate=18432, num_experts=256, top_k=8, moe_intermediate=2048,
        shared_intermediate=2048, num_groups=8,
        attention=Attention(heads=128, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128),
        layers=_stack(3, 61)),
    "glm-5": ModelShape(
        # huggingface.co/zai-org/GLM-5 config.json (GlmMoeDsaForCausalLM): hidden_size 6144,
        # intermediate_size 12288, moe_intermediate_size 2048, num_hidden_layers 78, first_k_dense_replace 3,
        # n_routed_experts 256, n_shared_experts 1, num_experts_per_tok 8, n_group 1, num_attention_heads 64,
        # q_lora_rank 2048, kv_lora_rank 512, qk_nope_head_dim 192, qk_rope_head_dim 64, v_head_dim 256,
        # index_topk 2048, index_n_heads 32, index_head_dim 128, vocab_size 154880 (served as GLM-5-FP8).
        name="glm-5", source="huggingface.co/zai-org/GLM-5/blob/main/config.json",
        hidden=6144, vocab=154880, dense_intermediate=12288, num_experts=256, top_k=8, moe_intermediate=2048,
        shared_intermediate=2048, num_groups=1,
        attention=Attention(heads=64, q_lora=2048, kv_lora=512, qk_nope=192, qk_rope=64, v_head=256,
                            index_topk=2048, index_heads=32, index_dim=128),
        layers=_stack(3, 78)),
    "qwen3.5-397b-a17b": ModelShape(
        # huggingface.co/Qwen/Qwen3.5-397B-A17B config.json (text_config): hidden_size 4096,
        # num_hidden_layers 60, layer_types three linear_attention then one full_attention, repeated;
        # num_experts 512, num_experts_per_tok 10, moe_intermediate_size 1024, shared_expert_intermediate_size
        # 1024, num_attention_heads 32, num_key_value_heads 2, head_dim 256, attn_output_gate true,
        # linear_num_value_heads 64, linear_num_key_heads 16, linear_key_head_dim 128, linear_value_head_dim
        # 128, vocab_size 248320 (served as Qwen3.5-397B-A17B-FP8).
        name="qwen3.5-397b-a17b", source="huggingface.co/Qwen/Qwen3.5-397B-A17B/blob/main/config.json",
        hidden=4096, vocab=248320, dense_intermediate=0, num_experts=512, top_k=10, moe_intermediate=1024,
        shared_intermediate=1024, num_groups=1,
        attention=Attention(heads=32, kv_heads=2, head_dim=256, gated=True, linear_v_heads=64, linear_k_heads=16,
                            linear_k_dim=128, linear_v_dim=128),
        layers=tuple(("gqa" if i % 4 == 3 else "gdn", True) for i in range(60))),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    name: str
    hbm_bytes_s: float
    hbm_bytes: float
    bf16_flops: float
    fp8_flops: float
    nvlink_bytes_s: float      # per direction, per GPU
    rdma_bytes_s: float        # per direction, per GPU (one NIC a GPU)


_NDR_400G = 400e9 / 8          # ConnectX-7 400 Gb/s InfiniBand NDR, one per GPU in DGX H100/H200/B200 (datasheets)

HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: FP8 3,958 / BF16 1,979 TFLOPS "with sparsity" (dense half),
    # HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s (both directions).
    "h100": Hardware(name="h100", hbm_bytes_s=3.35e12, hbm_bytes=80e9, bf16_flops=989e12, fp8_flops=1979e12,
                     nvlink_bytes_s=450e9, rdma_bytes_s=_NDR_400G),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: the H100's tensor cores (FP8 3,958 / BF16 1,979 sparse),
    # HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s.
    "h200": Hardware(name="h200", hbm_bytes_s=4.8e12, hbm_bytes=141e9, bf16_flops=989e12, fp8_flops=1979e12,
                     nvlink_bytes_s=450e9, rdma_bytes_s=_NDR_400G),
    # NVIDIA DGX B200 datasheet: 8 GPUs, 72 PFLOPS FP8 training (sparse) = 4.5 PFLOPS dense each, 1,440 GB
    # HBM3e at 64 TB/s (180 GB, 8 TB/s each), NVLink 5 at 1.8 TB/s per GPU (both directions); BF16 half of FP8.
    "b200": Hardware(name="b200", hbm_bytes_s=8e12, hbm_bytes=180e9, bf16_flops=2.25e15, fp8_flops=4.5e15,
                     nvlink_bytes_s=900e9, rdma_bytes_s=_NDR_400G),
}
