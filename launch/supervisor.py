"""Supervision of an EP group: notice a dead rank, restart the group, lose no request.

A rank is dead when its launcher says so (a Ray actor's call ended, an mp worker exited) or when a
collective fails (a peer died, the link broke, a step ran past the timeout). Recovery stops every
rank, starts a fresh group, reloads the weights and gives the engine the new runner; the engine
queues every unfinished request again from its prompt plus the tokens it has committed.
"""
from __future__ import annotations

import logging
import time

from ep.comm import CommError

log = logging.getLogger("metrale.supervisor")

DEFAULT_MAX_RESTARTS = 3


class GroupFailed(RuntimeError):
    """The group died more often than `--max-restarts` allows."""


class Supervisor:
    def __init__(self, llm, max_restarts: int = DEFAULT_MAX_RESTARTS) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts} must be at least 0")
        self.llm = llm
        self.max_restarts = max_restarts
        self.restarts = 0
        self.last_recovery_s: float | None = None

    def pending(self) -> str | None:
        """Why the group must be restarted now, or None while every rank is alive."""
        group = self.llm.group
        return group.dead() if group is not None else None

    def handles(self, exc: BaseException) -> bool:
        """Is `exc` a failure of the group (recoverable by a restart)?"""
        return self.llm.group is not None and (isinstance(exc, CommError) or self.pending() is not None)

    def reason(self, exc: BaseException) -> str:
        report = self.llm.group.failure_report() if self.llm.group is not None else ""
        return f"{exc}" + (f" ({report})" if report else "")

    def recover(self, reason: str) -> None:
        """Restart the group, retrying a failed restart, until `max_restarts` are spent; then
        raise `GroupFailed` naming the first reason."""
        t0 = time.perf_counter()
        why = reason
        while True:
            if self.restarts >= self.max_restarts:
                raise GroupFailed(f"the EP group failed ({why}); gave up after {self.restarts} "
                                  f"restart(s) (--max-restarts {self.max_restarts})")
            self.restarts += 1
            log.warning("EP group failed (%s): restart %d of at most %d", why, self.restarts, self.max_restarts)
            try:
                self.llm.restart_group()
                break
            except Exception as exc:
                why = f"restart {self.restarts} failed: {type(exc).__name__}: {exc}"
        self.last_recovery_s = time.perf_counter() - t0
        log.warning("EP group serving again after %.2f s (%d ranks)", self.last_recovery_s,
                    len(self.llm.rank_info))
