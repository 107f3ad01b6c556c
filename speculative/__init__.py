"""Speculative decoding: the draft-proposer interface, the MTP and n-gram proposers, verification,
acceptance metrics and the documented knobs."""
from speculative.fingerprint import hidden_fingerprint
from speculative.knobs import mtp_accept_debug, mtp_ep_propose_enabled, mtp_refeed_debug, mtp_refeed_shift, shadow_topk
from speculative.ladder import (DEFAULT_MTP_MAX_SEQS, MAX_MTP_MAX_SEQS, MtpMaxSeqsSource, ladder_drafts_from_steps,
                                mtp_catchup_enabled, mtp_ladder_disabled, mtp_ladder_drafts, mtp_ladder_pinned,
                                mtp_max_seqs, mtp_multi_seq_mode, mtp_refeed_accepted_enabled, parse_mtp_k_ladder, resolve_mtp_max_seqs, set_mtp_k_ladder, set_mtp_max_seqs)
from speculative.proposer import EP_CMD_MTP_PROPOSE, DraftProposer, Drafts, ProposerState, ProposeRequest

__all__ = ["DEFAULT_MTP_MAX_SEQS", "DraftProposer", "Drafts", "EP_CMD_MTP_PROPOSE", "MAX_MTP_MAX_SEQS",
           "MtpMaxSeqsSource", "ProposeRequest", "ProposerState", "hidden_fingerprint", "ladder_drafts_from_steps",
           "mtp_accept_debug", "mtp_catchup_enabled", "mtp_ep_propose_enabled", "mtp_ladder_disabled",
           "mtp_ladder_drafts", "mtp_ladder_pinned", "mtp_max_seqs", "mtp_multi_seq_mode",
           "mtp_refeed_accepted_enabled", "mtp_refeed_debug", "mtp_refeed_shift", "parse_mtp_k_ladder",
           "resolve_mtp_max_seqs", "set_mtp_k_ladder", "set_mtp_max_seqs", "shadow_topk"]
