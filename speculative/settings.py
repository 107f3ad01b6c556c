"""Speculation settings: one frozen, validated object, resolved once and passed down.

`resolve_spec_settings` gives every setting one precedence order: an explicit argument (the CLI's
flag, an `LLM(...)` keyword) first, then a value published once through the seed's API
(`set_mtp_k_ladder`, `set_mtp_max_seqs`, `set_draft_confidence_stop`; the CLI publishes what it
resolved), then the environment (docs/design.md §5.7), then the model folder's `metrale.toml`, then the
default. The engine, the depth policy and the drafters read only the resolved object; nothing
reads module state while serving.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from runtime.model.config import ConfigError, load_behavior
from speculative import draft_stop
from speculative import ladder as ladders
from speculative.knobs import (DrafterKnobs, canonical_key_min_width, drafter_knobs, mtp_accept_debug,
                               mtp_ep_propose_enabled, no_canonical_verify_key, tree_shape_env)
from speculative.ladder import (DEFAULT_MTP_K_LADDER, MtpMaxSeqsSource, ladder_drafts_from_steps, parse_mtp_k_ladder,
                                resolve_mtp_max_seqs)
from speculative.tree_shape import TreeShape

SPEC_METHODS = ("none", "mtp", "ngram")
DEPTH_POLICIES = ("fixed", "ladder", "auto")
VERIFY_MODES = ("exact", "rejection")
MAX_NUM_DRAFTS = 16
Ladder = tuple[tuple[int, int], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecSettings:
    """Everything about speculation that holds for the life of an engine.

    `num_drafts` is a depth (drafts per sequence per step, at most), never a row count.
    """
    method: str = "none"                 # none | mtp | ngram
    num_drafts: int = 0                  # the deepest chain a step may draft
    depth_policy: str = "ladder"         # fixed: num_drafts; ladder: by running width; auto: measured online
    ladder: Ladder = tuple(parse_mtp_k_ladder(DEFAULT_MTP_K_LADDER))
    ladder_disabled: bool = False        # METRALE_NO_MTP_K_LADDER: every width gets num_drafts
    width_cap: int = ladders.DEFAULT_MTP_MAX_SEQS
    width_cap_source: MtpMaxSeqsSource = MtpMaxSeqsSource.ENGINE_DEFAULT
    ladder_origin: str = "the default"   # where the ladder came from, in words (the depth policy's log)
    width_cap_origin: str = "the default"  # where the width cap came from, in words
    confidence_stop: float | None = None  # TAU of docs/design.md §5.4
    tree_shape: TreeShape | None = None  # draft trees instead of chains (MTP only)
    verify: str = "exact"                # exact: keyed target draws; rejection: rejection sampling
    canonical_min_width: int | None = 8  # narrowest verify in canonical order (None: never)
    ep_propose: bool = True              # the sharded drafter at EP > 1 (METRALE_NO_MTP_EP_PROPOSE=1: rank 0 alone)
    accept_debug: bool = False           # METRALE_MTP_ACCEPT_DEBUG
    knobs: DrafterKnobs = field(default_factory=DrafterKnobs)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"spec={self.method!r} is not a speculation method (expected one of "
                             f"{', '.join(SPEC_METHODS)})")
        if not 0 <= self.num_drafts <= MAX_NUM_DRAFTS:
            raise ValueError(f"num_drafts={self.num_drafts} must be in 0..{MAX_NUM_DRAFTS}")
        if self.depth_policy not in DEPTH_POLICIES:
            raise ValueError(f"draft_policy={self.depth_policy!r}: expected one of {', '.join(DEPTH_POLICIES)}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"spec_verify={self.verify!r}: expected one of {', '.join(VERIFY_MODES)}")
        if not self.ladder or any(n < 1 or d < 0 for n, d in self.ladder):
            raise ValueError(f"ladder {self.ladder} must be non-empty steps (n_max >= 1, drafts >= 0)")
        if not 1 <= self.width_cap <= ladders.MAX_MTP_MAX_SEQS:
            raise ValueError(f"mtp_max_seqs={self.width_cap} is outside 1..={ladders.MAX_MTP_MAX_SEQS}")
        if self.confidence_stop is not None and not 0.0 < self.confidence_stop < 1.0:
            raise ValueError(f"draft confidence stop {self.confidence_stop!r} must be strictly between 0 and 1")
        if self.tree_shape is not None:
            if self.method != "mtp":
                raise ValueError(f"a tree shape ({self.tree_shape.text}) needs spec='mtp': hedges are the MTP "
                                 "drafter's next-best tokens")
            if self.verify != "exact":
                raise ValueError(f"tree speculation verifies with keyed target draws only, not spec_verify="
                                 f"{self.verify!r}")

    @property
    def is_speculating(self) -> bool:
        return self.method != "none" and self.num_drafts > 0

    @property
    def ln_confidence_stop(self) -> float | None:
        """ln TAU, with TAU rounded to float32 as the drafters on every EP rank receive it."""
        if self.confidence_stop is None:
            return None
        return math.log(struct.unpack("<f", struct.pack("<f", self.confidence_stop))[0])

    def ladder_drafts(self, n_active: int) -> int:
        """Drafts per sequence for `n_active` running sequences by the ladder (docs/design.md §5.3)."""
        if self.ladder_disabled:
            return self.num_drafts
        return ladder_drafts_from_steps(list(self.ladder), n_active, self.num_drafts)

    def canonical_order(self, width: int) -> bool:
        """Does a verify of `width` sequences take the canonical dispatch order (docs/design.md §5.6)?"""
        return self.canonical_min_width is not None and width >= self.canonical_min_width


def model_width_cap(model_dir: Path | None, dtype: str | None = None) -> int | None:
    """`[behavior] mtp_max_seqs` of the model folder's metrale.toml (its `[behavior.<dtype>]`
    value first), or None."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    value = load_behavior(model_dir, dtype).get("mtp_max_seqs")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{model_dir}/metrale.toml [behavior] mtp_max_seqs={value!r} is not an integer")
    return value


def model_ladder(model_dir: Path | None, dtype: str | None = None) -> list[tuple[int, int]] | None:
    """`[behavior] mtp_k_ladder` of the model folder's metrale.toml (its `[behavior.<dtype>]`
    value first) parsed, or None when absent. A value that is not a ladder is refused (a folder's
    defaults are checked, not guessed)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    value = load_behavior(model_dir, dtype).get("mtp_k_ladder")
    if value is None:
        return None
    steps = parse_mtp_k_ladder(value) if isinstance(value, str) else None
    if steps is None:
        raise ConfigError(f"{model_dir}/metrale.toml [behavior] mtp_k_ladder={value!r} is not a ladder: expected "
                          "a string n_max:drafts[,n_max:drafts...], e.g. \"1:3,4:1\"")
    return steps


def behavior_origin(model_dir: Path, key: str, dtype: str | None) -> str:
    """Where a model folder's `key` comes from, in words: its metrale.toml's `[behavior.<dtype>]`
    table when that holds it, else the shared `[behavior]` table."""
    import tomllib
    path = Path(model_dir) / "metrale.toml"
    behavior = tomllib.loads(path.read_text()).get("behavior", {})   # load_behavior checked it already
    table = behavior.get(dtype) if dtype is not None else None
    return f"{path} [behavior.{dtype}]" if isinstance(table, dict) and key in table else f"{path} [behavior]"


def resolve_spec_settings(*, method: str = "none", num_drafts: int = 3, depth_policy: str | None = None,
                          k_ladder: str | None = None, width_cap: int | None = None,
                          confidence_stop: float | None = None, tree_shape: str | TreeShape | None = None,
                          verify: str = "exact", model_dir: str | Path | None = None,
                          dtype: str | None = None) -> SpecSettings:
    """Resolve speculation settings once: argument > published > environment > metrale.toml > default.
    `dtype`: the served dtype, whose `[behavior.<dtype>]` values in metrale.toml beat the shared ones.

    `k_ladder` is `--mtp-k-ladder`: a ladder text, or "auto" for the online depth controller. A
    pinned ladder (given here, published, or METRALE_MTP_K_LADDER present) turns "auto" back into
    the ladder. Refusals raise ValueError naming the value.
    """
    if method not in SPEC_METHODS:
        raise ValueError(f"spec={method!r} is not a speculation method (expected one of {', '.join(SPEC_METHODS)})")
    auto = k_ladder is not None and k_ladder.strip() == "auto"
    steps: list[tuple[int, int]] | None = None
    if k_ladder is not None and not auto:
        steps = parse_mtp_k_ladder(k_ladder)
        if steps is None:
            raise ValueError(f"--mtp-k-ladder {k_ladder!r} is not a ladder: expected n_max:drafts[,n_max:drafts...], "
                             "e.g. 4:3,8:3,16:1,32:1")
    dtype = str(dtype).removeprefix("torch.") if dtype is not None else None
    pinned = steps is not None or ladders.mtp_ladder_pinned()
    model = Path(model_dir) if model_dir else None
    ladder_origin = "--mtp-k-ladder" if steps is not None else "the default"
    if steps is None:   # published or METRALE_MTP_K_LADDER, else the folder's, else the default
        folder = None if pinned else model_ladder(model, dtype)
        steps = folder or ladders.current_ladder()
        if folder is not None:
            ladder_origin = behavior_origin(model, "mtp_k_ladder", dtype)
        elif pinned:
            ladder_origin = "--mtp-k-ladder" if ladders.ladder_published() else "METRALE_MTP_K_LADDER"
    policy = depth_policy or ("auto" if auto else "ladder")
    if policy == "auto" and pinned:
        policy = "ladder"
    disabled = ladders.mtp_ladder_disabled()
    if width_cap is not None:
        cap, source = resolve_mtp_max_seqs(width_cap, None, disabled)
    elif ladders.mtp_max_seqs_published():
        cap, source = ladders.published_max_seqs()
    else:
        cap, source = resolve_mtp_max_seqs(None, model_width_cap(model, dtype), disabled)
    cap_origin = {MtpMaxSeqsSource.CLI: "--mtp-max-seqs",
                  MtpMaxSeqsSource.ENGINE_DEFAULT: "the default"}.get(source)
    if cap_origin is None:
        cap_origin = behavior_origin(model, "mtp_max_seqs", dtype) if model is not None else "the model's default"
    stop = confidence_stop if confidence_stop is not None else draft_stop.draft_confidence_stop()
    shape = _tree_shape(tree_shape, method)
    return SpecSettings(method=method, num_drafts=num_drafts if method != "none" else 0, depth_policy=policy,
                        ladder=tuple(steps), ladder_disabled=disabled, width_cap=cap, width_cap_source=source,
                        ladder_origin=ladder_origin, width_cap_origin=cap_origin,
                        confidence_stop=stop, tree_shape=shape, verify=verify,
                        canonical_min_width=None if no_canonical_verify_key() else canonical_key_min_width(),
                        ep_propose=mtp_ep_propose_enabled(), accept_debug=mtp_accept_debug(),
                        knobs=drafter_knobs(cap))


def _tree_shape(given: str | TreeShape | None, method: str) -> TreeShape | None:
    """The draft-tree shape: the argument, else METRALE_TREE_SHAPE when speculating with MTP."""
    if isinstance(given, TreeShape):
        return given
    if given is not None:
        return TreeShape.parse(given)
    env = tree_shape_env()
    if env is None or method != "mtp":
        return None
    try:
        return TreeShape.parse(env)
    except ValueError as exc:
        raise ValueError(f"METRALE_TREE_SHAPE: {exc}") from None
