"""The process's environment variables, read in this one module: the documented METRALE_* knobs
(docs/design.md §5.7), read once per process, and TRITON_INTERPRET (Triton's own switch).

No other module reads the environment for behaviour. Each reader caches its first answer. A value
that does not parse keeps the documented fallback and says so once, in one warning line naming the
variable, its value and what is used instead.
"""
from __future__ import annotations

import logging
import os
from functools import cache

MAX_SHADOW_TOPK = 8

log = logging.getLogger("metrale.knobs")


def fallback(name: str, value: str, why: str, used: str) -> None:
    """Warn (one line) that METRALE_* variable `name` = `value` was not taken as given."""
    log.warning("%s=%r %s; using %s", name, value, why, used)


def _flag_is_one(name: str, effect: str) -> bool:
    """A `NAME=1` switch: true for "1"; any other value is ignored with a warning."""
    value = os.environ.get(name)
    if value is not None and value != "1":
        fallback(name, value, "is not 1 (the only value that turns it on)", f"the default ({effect} stays off)")
    return value == "1"


@cache
def mtp_accept_debug() -> bool:
    """METRALE_MTP_ACCEPT_DEBUG: on when set to any value; logs acceptance per width bucket."""
    return "METRALE_MTP_ACCEPT_DEBUG" in os.environ


@cache
def mtp_refeed_debug() -> bool:
    """METRALE_MTP_REFEED_DEBUG=1: log a `hidden_fingerprint` of every target row fed to the drafter."""
    return _flag_is_one("METRALE_MTP_REFEED_DEBUG", "refeed logging")


@cache
def shadow_topk() -> int:
    """METRALE_MTP_SHADOW_TOPK=k: log the drafter's top-k candidates at each draft position without
    changing selection. 0 (unset or unparseable) is off; k is capped at 8."""
    text = os.environ.get("METRALE_MTP_SHADOW_TOPK", "0")
    try:
        k = int(text.strip())
    except ValueError:
        fallback("METRALE_MTP_SHADOW_TOPK", text, "is not an integer", "0 (off)")
        return 0
    if not 0 <= k <= MAX_SHADOW_TOPK:
        fallback("METRALE_MTP_SHADOW_TOPK", text, f"is outside 0..{MAX_SHADOW_TOPK}",
                 str(max(0, min(k, MAX_SHADOW_TOPK))))
    return max(0, min(k, MAX_SHADOW_TOPK))


@cache
def mtp_k_ladder_env() -> str | None:
    """METRALE_MTP_K_LADDER as given (None when absent); speculative.ladder parses it."""
    return os.environ.get("METRALE_MTP_K_LADDER")


@cache
def mtp_no_k_ladder() -> bool:
    """METRALE_NO_MTP_K_LADDER present, with any value ("0" too): the ladder is off."""
    return "METRALE_NO_MTP_K_LADDER" in os.environ


@cache
def mtp_ep_propose_enabled() -> bool:
    """The sharded drafter: at EP > 1 every rank runs each propose with rank 0 (it sends the
    propose command first). METRALE_NO_MTP_EP_PROPOSE=1 turns it off: rank 0 drafts alone with
    its own share of the drafter's routed experts and no command is sent."""
    return not _flag_is_one("METRALE_NO_MTP_EP_PROPOSE", "drafting on rank 0 alone")


@cache
def _catchup_env() -> bool:
    return _flag_is_one("METRALE_MTP_CATCHUP", "catch-up")


@cache
def _refeed_accepted_env() -> bool:
    return _flag_is_one("METRALE_MTP_REFEED_ACCEPTED", "refeed of accepted rows")


def catchup_env() -> bool:
    """METRALE_MTP_CATCHUP=1 as given; `speculative.ladder.mtp_catchup_enabled` adds the
    multi-sequence check."""
    return _catchup_env()


def refeed_accepted_env() -> bool:
    """METRALE_MTP_REFEED_ACCEPTED=1 as given."""
    return _refeed_accepted_env()


@cache
def mtp_refeed_shift() -> int:
    """METRALE_MTP_REFEED_SHIFT: offset added to every re-fed ring label (the token paired with a
    re-fed hidden), clamped to [-4, 4]; 0 when unset or unparseable. For testing the mapping."""
    text = os.environ.get("METRALE_MTP_REFEED_SHIFT", "0")
    try:
        shift = int(text.strip())
    except ValueError:
        fallback("METRALE_MTP_REFEED_SHIFT", text, "is not an integer", "0")
        return 0
    if not -4 <= shift <= 4:
        fallback("METRALE_MTP_REFEED_SHIFT", text, "is outside -4..4", str(max(-4, min(4, shift))))
    return max(-4, min(4, shift))


@cache
def tree_shape_env() -> str | None:
    """METRALE_TREE_SHAPE as given (None when absent); speculative.tree_shape parses it."""
    return os.environ.get("METRALE_TREE_SHAPE")


DEFAULT_CANONICAL_KEY_MIN_WIDTH = 8


@cache
def canonical_key_min_width() -> int:
    """METRALE_CANONICAL_KEY_MIN_WIDTH: the narrowest batched verify that takes the canonical order.
    Spaces around the number are allowed; unset or not a non-negative integer gives 8."""
    raw = os.environ.get("METRALE_CANONICAL_KEY_MIN_WIDTH")
    text = (raw or "").strip()
    if raw is not None and not text.isdigit():
        fallback("METRALE_CANONICAL_KEY_MIN_WIDTH", raw, "is not a non-negative integer",
                 str(DEFAULT_CANONICAL_KEY_MIN_WIDTH))
    return int(text) if text.isdigit() else DEFAULT_CANONICAL_KEY_MIN_WIDTH


@cache
def no_canonical_verify_key() -> bool:
    """METRALE_NO_CANONICAL_VERIFY_KEY present, with any value: batched verifies keep the legacy order."""
    return "METRALE_NO_CANONICAL_VERIFY_KEY" in os.environ


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels on CPU tensors through its interpreter (triton reads
    it when imported; read afresh on every call, as triton itself reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
