"""Speculative decoding: the draft-proposer interface, the MTP and n-gram proposers, verification,
acceptance metrics and the documented knobs."""
from ep.protocol import EP_CMD_MTP_PROPOSE
from speculative.fingerprint import hidden_fingerprint
from speculative.knobs import mtp_accept_debug, mtp_refeed_debug, shadow_topk
from speculative.proposer import DraftProposer, Drafts, ProposerState, ProposeRequest

__all__ = ["DraftProposer", "Drafts", "EP_CMD_MTP_PROPOSE", "ProposeRequest", "ProposerState",
           "hidden_fingerprint", "mtp_accept_debug", "mtp_refeed_debug", "shadow_topk"]
