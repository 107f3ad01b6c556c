"""A warm deployment's heap is out of the garbage collector's reach (runtime.platform.heap), and freezing
never keeps a dead engine alive: the next freeze, or a shutdown, gives it back."""
from __future__ import annotations

import gc
import weakref
from pathlib import Path

from runtime.platform.heap import freeze_heap, thaw_heap
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM

MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-glm-moe"


def test_warm_up_freezes_the_heap_and_shutdown_thaws_it():
    thaw_heap()
    llm = LLM(MODEL, dtype="float32", kv_cache_tokens=1024, enforce_eager=True)
    try:
        assert gc.get_freeze_count() == 0          # built, not warm yet
        out = llm.generate([[5, 17, 200]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
        frozen = gc.get_freeze_count()
        # The model's modules and the engine are among the frozen objects.
        assert frozen > 10_000
        llm.generate([[9, 9, 9, 100]], SamplingParams(max_tokens=2, ignore_eos=True))
        # A warm deployment does not freeze again: the count does not grow (it may fall, by frozen
        # objects that their last reference let go of since, e.g. an earlier test's in this worker).
        assert gc.get_freeze_count() <= frozen
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_dropped_engine_is_collected_by_the_next_freeze():
    """Engines hold reference cycles (they are freed by the collector, not by reference counts):
    one dropped without shutdown after its heap was frozen is reclaimed when the heap is frozen
    again."""
    thaw_heap()
    llm = LLM(MODEL, dtype="float32", kv_cache_tokens=1024, enforce_eager=True)
    llm.generate([[5, 17, 200]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert gc.get_freeze_count() > 0
    cache = weakref.ref(llm.engine.runner.cache)
    del llm
    gc.collect()
    assert cache() is not None                     # frozen: the collector does not see the cycle
    freeze_heap()
    assert cache() is None
    thaw_heap()
