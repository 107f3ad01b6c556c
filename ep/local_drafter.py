"""Rank 0's drafter of its own (METRALE_NO_MTP_EP_PROPOSE=1): no command, no collective.

The MTP layer is loaded again on rank 0 without tensor parallelism (every attention head, the
whole head over the vocabulary) but with only rank 0's share of its routed experts: a token routed
to another rank's expert gets nothing from it. Its keys and values live in a plane of their own
that shares the main cache's blocks and tables, so the engine's reserve, rewind and free apply to
it unchanged. Verification is untouched, so output stays lossless; acceptance drops with the
experts the drafter lacks.
"""
from __future__ import annotations

from pathlib import Path

from ep.topology import EPTopology
from runtime.model.config import load_config
from runtime.executor.kv_cache import PagedKVCache
from runtime.model.weights import load_model
from speculative.knobs import DrafterKnobs
from speculative.mtp import MTPProposer


def load_local_drafter(model_dir: str | Path, dtype: str, rank: int, world_size: int, cache: PagedKVCache,
                       confidence_stop: float | None = None, knobs: DrafterKnobs | None = None) -> MTPProposer:
    """An `MTPProposer` on rank `rank`'s experts only, drafting without the other ranks."""
    topo = EPTopology.of(load_config(model_dir), rank, world_size)
    model = load_model(model_dir, dtype, expert_range=topo.expert_range(), mtp_only=True, device=cache.device)
    attn = model.mtp.block.self_attn
    attn.layer_idx = 0  # the plane's only layer
    layout = model.cache_layout()
    plane = cache.shared_plane(num_layers=1, num_kv_heads=layout["num_kv_heads"], head_dim=layout["head_dim"],
                               dtype=cache.k.dtype)
    return MTPProposer(model, plane, confidence_stop, knobs)
