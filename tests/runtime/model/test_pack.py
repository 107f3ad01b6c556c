"""`pack_for_inference`: fused projections and column-major CPU weights change no value, no name
and no memory; the cache gather equals advanced indexing."""
from __future__ import annotations

import pytest
import torch

from runtime.executor.attention import CausalAttention
from runtime.executor.kv_cache import PagedKVCache
from runtime.model.experts import RoutedExperts
from runtime.model.layers import MLP, Attention, FusedProjection, pack_for_inference
from runtime.model.causal_lm import CausalLM
from runtime.model.weights import iter_hf_state, load_model


def _unpacked_copy(model: CausalLM) -> CausalLM:
    plain = CausalLM(model.config, mtp_own_embed=model.mtp is not None and model.mtp.embed_tokens is not None,
                     mtp_own_head=model.mtp is not None and model.mtp.shared_head.head is not None)
    plain.load_state_dict({k: v.contiguous() for k, v in model.state_dict().items()})
    return plain.to(model.dtype).eval()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_packed_model_computes_what_the_plain_one_does(ckpt_grouped, dtype):
    packed = load_model(ckpt_grouped, dtype, device="cpu")
    fused = [m for m in packed.modules() if isinstance(m, FusedProjection)]
    attn = [m for m in packed.modules() if isinstance(m, Attention)]
    mlps = [m for m in packed.modules() if isinstance(m, MLP)]
    assert len(fused) == len(attn) + len(mlps) and all(m.qkv is not None for m in attn)
    plain = _unpacked_copy(packed)
    assert all(m.qkv is None for m in plain.modules() if isinstance(m, Attention))
    torch.manual_seed(0)
    tokens = torch.randint(0, packed.config.vocab_size, (2 * 9,))
    positions = torch.arange(9).repeat(2)
    with torch.no_grad():
        a = packed.compute_logits(packed(tokens, positions, CausalAttention(2, 9)))
        b = plain.compute_logits(plain(tokens, positions, CausalAttention(2, 9)))
    if dtype == "float64":
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_packing_keeps_names_and_shares_memory(ckpt_grouped):
    model = load_model(ckpt_grouped, "float32", device="cpu")
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    storage = attn.qkv.weight.untyped_storage().data_ptr()
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):   # views of the fused rows, not copies
        assert lin.weight.untyped_storage().data_ptr() == storage
    assert attn.qkv.weight.t().is_contiguous() and attn.o_proj.weight.t().is_contiguous()
    experts = next(m for m in model.modules() if isinstance(m, RoutedExperts))
    assert experts.gate_up_proj[0].t().is_contiguous()
    assert not any(".qkv." in k or ".gate_up." in k for k in model.state_dict())
    assert all(t.is_contiguous() for _, t in iter_hf_state(model))   # what safetensors writes
    fresh = _unpacked_copy(model)
    assert set(fresh.state_dict()) == set(model.state_dict())


def test_packing_twice_changes_nothing(ckpt_grouped):
    model = load_model(ckpt_grouped, "float64", device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused = [id(m) for m in model.modules() if isinstance(m, FusedProjection)]
    pack_for_inference(model)
    assert [id(m) for m in model.modules() if isinstance(m, FusedProjection)] == fused
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fusion_refuses_linears_of_different_inputs():
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)
    with pytest.raises(ValueError, match="input features"):
        FusedProjection([a, b])


def test_cache_gather_equals_advanced_indexing():
    cache = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=3,
                         dtype=torch.float32, device="cpu")
    cache.k.copy_(torch.randn_like(cache.k))
    cells = torch.tensor([[5, 1, 7, 0], [2, 2, 30, 9]])
    assert torch.equal(cache.gather(cache.k[0], cells), cache.k[0][cells])
    latent = PagedKVCache(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=6, latent_dim=4, device="cpu")
    latent.k.copy_(torch.randn_like(latent.k))
    assert not latent.v[0].is_contiguous()   # values are a view of the keys' first channels
    assert torch.equal(latent.gather(latent.v[0], cells), latent.v[0][cells])
