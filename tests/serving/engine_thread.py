"""An `AsyncEngine` whose loop runs on the thread that built its `LLM` (as `metrale serve` runs it),
counting the steps it takes: what the serving tests drive in process."""
from __future__ import annotations

import threading

from serving.async_engine import AsyncEngine
from serving.llm import LLM


def start_counted_engine(ckpt, dtype: str = "float64") -> tuple[dict, threading.Thread]:
    """Build an `LLM` on a new thread and run its engine loop there -> (box, thread): box["aengine"]
    is the running `AsyncEngine`, box["steps"] the steps taken so far. Stop it with
    `box["aengine"].shutdown()` and join the thread."""
    built = threading.Event()
    box: dict = {"steps": 0}

    def engine_thread() -> None:
        llm = LLM(ckpt, dtype=dtype)
        step = llm.deployment.step

        def counted(engine):
            box["steps"] += 1
            return step(engine)
        llm.deployment.step = counted
        box["aengine"] = AsyncEngine(llm.engine, llm.deployment)
        built.set()
        try:
            box["aengine"].run()
        finally:
            llm.shutdown()

    thread = threading.Thread(target=engine_thread, daemon=True)
    thread.start()
    assert built.wait(timeout=120)
    return box, thread
