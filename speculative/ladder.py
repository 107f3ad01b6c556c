"""Per-step MTP draft count as a function of the number of active sequences (the K-versus-width
ladder), and the multi-sequence MTP width cap (docs/design.md §5.3).

A ladder is a list of steps `n_max:drafts` sorted by n_max. For `n_active` sequences the first
step with n_active <= n_max gives the drafts (the last step beyond the largest n_max), clamped to
1..=num_drafts; 0 when num_drafts is 0. The CLI publishes a ladder once and beats the
environment; an unparseable environment value gives the default ladder.
"""
from __future__ import annotations

import enum
import re

from functools import cache

from speculative.knobs import catchup_env, fallback, mtp_k_ladder_env, mtp_no_k_ladder, refeed_accepted_env

DEFAULT_MTP_K_LADDER = "4:3,8:3,16:1,32:1"
DEFAULT_MTP_MAX_SEQS = 32
DEFAULT_MTP_MAX_SEQS_NO_LADDER = 4
MAX_MTP_MAX_SEQS = 128

_STEP = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class MtpMaxSeqsSource(enum.Enum):
    CLI = "cli"
    MODEL_DEFAULT = "model_default"
    ENGINE_DEFAULT = "engine_default"


def parse_mtp_k_ladder(text: str | None) -> list[tuple[int, int]] | None:
    """`"4:3, 8:3"` -> [(4, 3), (8, 3)] sorted by n_max; None unless every part parses (n_max >= 1)."""
    if not text or not text.strip():
        return None
    steps = []
    for part in text.split(","):
        m = _STEP.match(part)
        if m is None or int(m.group(1)) < 1:
            return None
        steps.append((int(m.group(1)), int(m.group(2))))
    return sorted(steps, key=lambda s: s[0])


def ladder_drafts_from_steps(steps: list[tuple[int, int]], n_active: int, num_drafts: int) -> int:
    if num_drafts <= 0:
        return 0
    if not steps:
        return num_drafts
    drafts = next((d for n_max, d in steps if n_active <= n_max), steps[-1][1])
    return max(1, min(drafts, num_drafts))


_published_ladder: tuple[str, list[tuple[int, int]]] | None = None
_published_max_seqs: tuple[int, MtpMaxSeqsSource] | None = None


def set_mtp_k_ladder(text: str) -> None:
    """Publish the CLI's ladder once; it beats METRALE_MTP_K_LADDER. Refuses text that does not
    parse, and a second, different ladder."""
    global _published_ladder
    steps = parse_mtp_k_ladder(text)
    if steps is None:
        raise ValueError(f"--mtp-k-ladder {text!r} is not a ladder: expected n_max:drafts[,n_max:drafts...], "
                         "e.g. 4:3,8:3,16:1,32:1")
    if _published_ladder is not None and _published_ladder[1] != steps:
        raise ValueError(f"the MTP ladder was already published as {_published_ladder[0]!r}; refusing {text!r}")
    _published_ladder = (text, steps)


def ladder_published() -> bool:
    """True when a ladder was published (the CLI's --mtp-k-ladder)."""
    return _published_ladder is not None


def mtp_ladder_disabled() -> bool:
    return mtp_no_k_ladder()


def mtp_ladder_pinned() -> bool:
    """True when --mtp-k-ladder was given or METRALE_MTP_K_LADDER is present (even if it fell back)."""
    return _published_ladder is not None or mtp_k_ladder_env() is not None


@cache
def _env_ladder() -> list[tuple[int, int]]:
    """METRALE_MTP_K_LADDER parsed, else the default ladder (with one warning when it was set)."""
    text = mtp_k_ladder_env()
    steps = parse_mtp_k_ladder(text)
    if steps is None and text is not None:
        fallback("METRALE_MTP_K_LADDER", text, "is not a ladder (n_max:drafts[,n_max:drafts...])",
                 f"the default {DEFAULT_MTP_K_LADDER}")
    return steps or parse_mtp_k_ladder(DEFAULT_MTP_K_LADDER)


def current_ladder() -> list[tuple[int, int]]:
    if _published_ladder is not None:
        return _published_ladder[1]
    return _env_ladder()


def mtp_ladder_drafts(n_active: int, num_drafts: int) -> int:
    """Drafts per sequence this step for `n_active` sequences (num_drafts everywhere when disabled)."""
    if mtp_ladder_disabled():
        return max(0, num_drafts)
    return ladder_drafts_from_steps(current_ladder(), n_active, num_drafts)


def resolve_mtp_max_seqs(cli: int | None, model_default: int | None,
                         ladder_disabled: bool) -> tuple[int, MtpMaxSeqsSource]:
    """The width cap and where it came from: the CLI, else the model's metrale.toml when above 0,
    else the engine default (32; 4 when the ladder is disabled). Outside 1..=128 is refused."""
    if cli is not None:
        n, source = cli, MtpMaxSeqsSource.CLI
    elif model_default is not None and model_default > 0:
        n, source = model_default, MtpMaxSeqsSource.MODEL_DEFAULT
    else:
        n = DEFAULT_MTP_MAX_SEQS_NO_LADDER if ladder_disabled else DEFAULT_MTP_MAX_SEQS
        source = MtpMaxSeqsSource.ENGINE_DEFAULT
    if not 1 <= n <= MAX_MTP_MAX_SEQS:
        raise ValueError(f"mtp_max_seqs={n} (from {source.value}) is outside 1..={MAX_MTP_MAX_SEQS}")
    return n, source


def set_mtp_max_seqs(n: int, source: MtpMaxSeqsSource = MtpMaxSeqsSource.CLI) -> None:
    """Publish the width cap once; a different value later is refused."""
    global _published_max_seqs
    if not 1 <= n <= MAX_MTP_MAX_SEQS:
        raise ValueError(f"mtp_max_seqs={n} is outside 1..={MAX_MTP_MAX_SEQS}")
    if _published_max_seqs is not None and _published_max_seqs[0] != n:
        raise ValueError(f"mtp_max_seqs was already published as {_published_max_seqs[0]}; refusing {n}")
    _published_max_seqs = (n, source)


def mtp_max_seqs_published() -> bool:
    return _published_max_seqs is not None


def published_max_seqs() -> tuple[int, MtpMaxSeqsSource]:
    """The published width cap and its source; ValueError when none was published."""
    if _published_max_seqs is None:
        raise ValueError("no width cap was published (set_mtp_max_seqs)")
    return _published_max_seqs


def mtp_max_seqs() -> int:
    """The published width cap, else the engine default."""
    if _published_max_seqs is not None:
        return _published_max_seqs[0]
    return resolve_mtp_max_seqs(None, None, mtp_ladder_disabled())[0]


def mtp_multi_seq_mode() -> bool:
    """True when the width cap (the most sequences that speculate together) is above one: the
    published cap, else the engine default. The engine and the drafter read the resolved
    `SpecSettings` instead."""
    return mtp_max_seqs() > 1


def mtp_catchup_enabled() -> bool:
    """METRALE_MTP_CATCHUP=1, and not in multi-sequence mode. The drafter is always fed every
    committed target hidden it has not seen before a propose; this knob gates the refeed shift."""
    return catchup_env() and not mtp_multi_seq_mode()


def mtp_refeed_accepted_enabled() -> bool:
    """METRALE_MTP_REFEED_ACCEPTED=1 with catch-up on (off in multi-sequence mode): accepted
    positions are fed the target's hiddens, never the drafter's own outputs (always true here)."""
    return refeed_accepted_env() and mtp_catchup_enabled()
