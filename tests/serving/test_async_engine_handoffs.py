"""The engine thread's hand-offs to the event loop: a step's updates arrive in one delivery, and a
request that asked for no progress (non-streaming) hears only that it ended."""
from __future__ import annotations

import asyncio

from runtime.sample.sampler import SamplingParams
from serving.async_engine import AsyncEngine
from tests.serving.engine_thread import start_counted_engine

PROMPT = [5, 17, 42, 99, 7]
MAX_TOKENS = 6


def test_a_steps_updates_reach_the_loop_in_one_delivery(ckpt_plain):
    box, thread = start_counted_engine(ckpt_plain)   # builds and steps on one thread, as `metrale serve` does
    aengine: AsyncEngine = box["aengine"]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def read_all(handle) -> list:
        items = []
        while not (items and all(u.finished for u in items[-1])):
            items.append(await asyncio.wait_for(handle.updates.get(), timeout=60))
        return items

    async def main():
        streams = [await aengine.submit([(PROMPT, params)]) for _ in range(3)]
        quiet = await aengine.submit([(PROMPT, params)], progress=False)
        return await asyncio.gather(*(read_all(h) for h in streams)), await read_all(quiet)

    try:
        stream_items, quiet_items = asyncio.run(main())
    finally:
        aengine.shutdown()
        thread.join(timeout=60)
    for items in stream_items:    # every step's count, in order, up to the end
        counts = [u.num_output for (u,) in items]
        assert counts == sorted(counts) and counts[-1] == MAX_TOKENS and len(counts) >= MAX_TOKENS - 1, counts
    assert [[(u.num_output, u.finished) for u in item] for item in quiet_items] == [[(MAX_TOKENS, True)]]
    # One delivery per step at most (per request and step it was 3-4 a step): 4 requests, ~6 steps.
    assert 0 < aengine.num_handoffs <= box["steps"], (aengine.num_handoffs, box["steps"])
