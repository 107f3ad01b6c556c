"""The engine on its own thread, so the server's event loop never waits on a forward.

Requests and aborts go to the engine thread through a queue. A request is one or more sequences
(the n choices of each of its prompts), added in one go so they share steps. After every step the
thread tells each affected request's asyncio queue, in one list ordered by choice index, how many
output tokens each sequence has now and whether it ended. Committed tokens (and their logprobs)
are only ever appended, so a reader that slices `token_ids[:n]` with the `n` it was told always
sees a consistent prefix.
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
    index: int          # which of the request's sequences
    num_output: int
    finished: bool


class RequestHandle:
    """What the server holds for one request: the engine's sequences (set on the engine thread
    before their first update) and one queue of update lists."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_seqs: int) -> None:
        self.loop = loop
        self.updates: asyncio.Queue[list[Update] | BaseException] = asyncio.Queue()
        self.seqs: list[Sequence | None] = [None] * num_seqs


class AsyncEngine:
    def __init__(self, engine: Engine, deployment: Deployment,
                 on_step: Callable[[Engine], None] | None = None) -> None:
        """Steps go through `deployment.step`, which restarts a failed EP group and carries on;
        the engine object stays, its requests continue where they were."""
        self.engine = engine
        self.deployment = deployment
        self.on_step = on_step
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[int, tuple[RequestHandle, int]] = {}    # seq_id -> (handle, index)
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="metrale-engine", daemon=True)
        self._thread.start()

    # --- event-loop side ------------------------------------------------------------------
    async def submit(self, seqs: list[tuple[list[int], SamplingParams]]) -> RequestHandle:
        """Validate (raises `RequestError`) and queue a request of one or more sequences
        (prompt ids, params); returns its handle."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        for prompt_ids, params in seqs:
            self.engine.validate_request(prompt_ids, params)
        handle = RequestHandle(asyncio.get_running_loop(), len(seqs))
        self._inbox.put(("add", handle, seqs))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self._inbox.put(("abort", handle))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)

    # --- engine thread --------------------------------------------------------------------
    def _notify(self, handle: RequestHandle, item: list[Update] | BaseException) -> None:
        handle.loop.call_soon_threadsafe(handle.updates.put_nowait, item)

    def _drain(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if msg[0] == "add":
                _, handle, seqs = msg
                try:
                    for i, (prompt_ids, params) in enumerate(seqs):
                        handle.seqs[i] = self.engine.add_request(prompt_ids, params)
                        self._handles[handle.seqs[i].seq_id] = (handle, i)
                except Exception as exc:  # refused after all (e.g. the cache cannot ever hold it)
                    self._abort(handle)
                    self._notify(handle, exc)
            elif msg[0] == "abort":
                self._abort(msg[1])
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, handle: RequestHandle) -> None:
        for seq in handle.seqs:
            if seq is not None and not seq.is_finished:
                self.engine.abort(seq)
            if seq is not None:
                self._handles.pop(seq.seq_id, None)

    def _step(self) -> None:
        outcome = self.deployment.step(self.engine)
        if outcome.recovered:
            # A restart: tell every request where it stands (a step that failed half way may
            # have committed tokens or finished requests nobody has heard of yet).
            done = [h.seqs[i] for h, i in self._handles.values()]
        else:
            done = outcome.done
        per_handle: dict[int, tuple[RequestHandle, list[Update]]] = {}
        for seq in done:
            entry = self._handles.get(seq.seq_id)
            if entry is None:
                continue
            handle, index = entry
            per_handle.setdefault(id(handle), (handle, []))[1].append(Update(index, seq.num_output, seq.is_finished))
            if seq.is_finished:
                del self._handles[seq.seq_id]
        for handle, updates in per_handle.values():
            self._notify(handle, sorted(updates, key=lambda u: u.index))

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
            for handle in {id(h): h for h, _ in self._handles.values()}.values():
                self._notify(handle, exc)
