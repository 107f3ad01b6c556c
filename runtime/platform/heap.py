"""The process heap out of the garbage collector's reach while serving.

Python's cyclic collector walks every object it tracks in its oldest generation's collections.
A serving process holds hundreds of thousands of long-lived objects: torch's and transformers'
modules, the model's, and with compiled steps Dynamo's and inductor's graphs, guards and symbolic
shapes (the embedded model: ~290,000 objects eager, ~460,000 compiled). Each full collection then
costs 130-260 ms on this CPU, and it comes at a step chosen by allocation counts: one request's
token waits that long, and in a bench run of 5 arms they added up to ~2 s. `freeze_heap`, once
the deployment is built and warm, collects what is garbage and moves every survivor to the
permanent generation (`gc.freeze`), which no collection walks; later collections see only what
serving allocates. vLLM's engine freezes its start-up heap the same way.

Frozen objects that die in a reference cycle are not reclaimed until they are thawed: a freeze
first thaws and collects everything (so a restarted EP group's old runner, or an engine dropped
without shutdown, is freed then), and `thaw_heap` at shutdown gives the rest back.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("metrale.heap")


def freeze_heap() -> int:
    """Thaw, collect every generation, then freeze what is left; returns how many objects were
    frozen."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d heap objects in %.0f ms", frozen, 1000 * (time.perf_counter() - t0))
    return frozen


def thaw_heap() -> None:
    """Give every frozen object back to the collector (the oldest generation)."""
    gc.unfreeze()
