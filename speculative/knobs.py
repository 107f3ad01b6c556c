"""The documented METRALE_* knobs (DESIGN §5.7), read once per process in this one module."""
from __future__ import annotations

import os
from functools import cache


@cache
def mtp_accept_debug() -> bool:
    """METRALE_MTP_ACCEPT_DEBUG: on when set to any value; logs acceptance per width bucket."""
    return "METRALE_MTP_ACCEPT_DEBUG" in os.environ
