"""The engine on its own thread, so the server's event loop never waits on a forward.

Requests and aborts go to the engine thread through a queue; after every step the thread tells
each affected request's asyncio queue how many output tokens it has now and whether it ended.
Committed tokens are only ever appended, so a reader that slices `token_ids[:n]` with the `n` it
was told always sees a consistent prefix.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.engine import Engine
from runtime.sampler import SamplingParams
from runtime.sequence import Sequence
from serving.deployment import Deployment

log = logging.getLogger("metrale.async_engine")


@dataclass(frozen=True, slots=True)
class Update:
    num_output: int
    finished: bool


class RequestHandle:
    """What the server holds for one request: the engine's sequence and a queue of updates."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.updates: asyncio.Queue[Update | BaseException] = asyncio.Queue()
        self.seq: Sequence | None = None


class AsyncEngine:
    def __init__(self, engine: Engine, deployment: Deployment,
                 on_step: Callable[[Engine], None] | None = None) -> None:
        """Steps go through `deployment.step`, which restarts a failed EP group and carries on;
        the engine object stays, its requests continue where they were."""
        self.engine = engine
        self.deployment = deployment
        self.on_step = on_step
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[int, RequestHandle] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="metrale-engine", daemon=True)
        self._thread.start()

    # --- event-loop side ------------------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Validate (raises `RequestError`) and queue a request; returns its handle."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        self.engine.validate_request(prompt_ids, params)
        handle = RequestHandle(asyncio.get_running_loop())
        self._inbox.put(("add", handle, prompt_ids, params))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self._inbox.put(("abort", handle))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)

    # --- engine thread --------------------------------------------------------------------
    def _notify(self, handle: RequestHandle, item: Update | BaseException) -> None:
        handle.loop.call_soon_threadsafe(handle.updates.put_nowait, item)

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if msg[0] == "add":
                _, handle, prompt_ids, params = msg
                try:
                    handle.seq = self.engine.add_request(prompt_ids, params)
                    self._handles[handle.seq.seq_id] = handle
                except Exception as exc:  # refused after all (e.g. the cache cannot ever hold it)
                    self._notify(handle, exc)
            elif msg[0] == "abort":
                handle = msg[1]
                if handle.seq is not None and not handle.seq.is_finished:
                    self.engine.abort(handle.seq)
                    self._handles.pop(handle.seq.seq_id, None)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        outcome = self.deployment.step(self.engine)
        if outcome.recovered:
            # A restart: tell every request where it stands (a step that failed half way may
            # have committed tokens or finished requests nobody has heard of yet).
            done = [h.seq for h in self._handles.values()]
        else:
            done = outcome.done
        for seq in done:
            handle = self._handles.get(seq.seq_id)
            if handle is None:
                continue
            self._notify(handle, Update(seq.num_output, seq.is_finished))
            if seq.is_finished:
                del self._handles[seq.seq_id]

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                self._step()  # also after aborts, which change the batch without a step
                if self.on_step is not None:
                    self.on_step(self.engine)
        except BaseException as exc:  # a broken engine fails every waiting request, loudly
            log.exception("engine thread failed")
            self.error = exc
            for handle in self._handles.values():
                self._notify(handle, exc)
