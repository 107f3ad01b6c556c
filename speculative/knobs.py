"""The drafter's knobs, resolved once from the METRALE_* variables that `runtime.platform.env`
reads (the project's one reader of the environment); the readers are re-exported here for the
modules of speculation."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.platform.env import (
    DEFAULT_CANONICAL_KEY_MIN_WIDTH, MAX_SHADOW_TOPK, _catchup_env,
    _refeed_accepted_env, canonical_key_min_width, catchup_env, fallback, mtp_accept_debug,
    mtp_ep_propose_enabled, mtp_k_ladder_env, mtp_no_k_ladder, mtp_refeed_debug,
    mtp_refeed_shift, no_canonical_verify_key, refeed_accepted_env, shadow_topk, tree_shape_env)

__all__ = [
    "DEFAULT_CANONICAL_KEY_MIN_WIDTH", "MAX_SHADOW_TOPK", "_catchup_env",
    "_refeed_accepted_env", "canonical_key_min_width", "catchup_env", "fallback",
    "mtp_accept_debug", "mtp_ep_propose_enabled", "mtp_k_ladder_env", "mtp_no_k_ladder",
    "mtp_refeed_debug", "mtp_refeed_shift", "no_canonical_verify_key", "refeed_accepted_env",
    "shadow_topk", "tree_shape_env", "DrafterKnobs", "drafter_knobs"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DrafterKnobs:
    """The drafter's debugging knobs, resolved once (see `speculative.settings`)."""
    shadow_topk: int = 0          # METRALE_MTP_SHADOW_TOPK
    refeed_debug: bool = False    # METRALE_MTP_REFEED_DEBUG=1
    refeed_shift: int = 0         # METRALE_MTP_REFEED_SHIFT, in effect only with catch-up on and a width cap of 1

    def __post_init__(self) -> None:
        if not 0 <= self.shadow_topk <= MAX_SHADOW_TOPK:
            raise ValueError(f"shadow_topk={self.shadow_topk} is outside 0..{MAX_SHADOW_TOPK}")
        if not -4 <= self.refeed_shift <= 4:
            raise ValueError(f"refeed_shift={self.refeed_shift} is outside -4..4")


def drafter_knobs(width_cap: int) -> DrafterKnobs:
    """The drafter knobs of this process for a width cap (the refeed shift needs catch-up, which
    multi-sequence mode turns off)."""
    shift = mtp_refeed_shift() if _catchup_env() and width_cap <= 1 else 0
    return DrafterKnobs(shadow_topk=shadow_topk(), refeed_debug=mtp_refeed_debug(), refeed_shift=shift)
