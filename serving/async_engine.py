"""The engine's step loop, run on the thread that built the engine; the server's event loop runs
on another thread and never waits on a forward.

Every piece of torch work (load, compile, warm-up, steps, shutdown) runs on one thread: the one
that built the deployment (`Deployment.thread_id`), which `run` checks. torch's CPU build runs its
intra-op parallelism on GNU OpenMP, which gives every OS thread that opens a parallel region a thread
team of its own; a second team makes libgomp manage more threads than there are CPUs, and it then
spins only briefly before sleeping, so every parallel region of the step waits on woken threads
(a lone request at a fifth of the offline engine's speed on 2 cores, docs/design.md §6). The event
loop's thread only tokenizes, detokenizes and encodes JSON, none of which opens a parallel region.

Requests and aborts go to the engine thread through a queue. A request is one or more sequences
(the n choices of each of its prompts), added in one go so they share steps. After every step the
thread tells each affected request's asyncio queue, in one list ordered by choice index, how many
output tokens each sequence has now and whether it ended. Committed tokens (and their logprobs)
are only ever appended, so a reader that slices `token_ids[:n]` with the `n` it was told always
sees a consistent prefix.

Bounds (`QueueLimits`): at most `max_waiting` sequences wait for a place in the batch (submitted,
not yet running; a preempted one waits again), beyond that `submit` raises `QueueFull`, so a flood
costs a refusal each, never memory. A request still unfinished `request_timeout_s` after it was
submitted is aborted on the engine thread with finish reason `timeout` (its KV blocks are freed at
once); `end_all(reason)` does the same to every open request (a drain that ran out of time).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.engine import Engine
from runtime.sample.sampler import SamplingParams
from engine.sequence import Sequence
from serving.deployment import Deployment

log = logging.getLogger("metrale.async_engine")

DEFAULT_MAX_WAITING = 512
TIMEOUT = "timeout"      # finish reason of a request that passed --request-timeout
SHUTDOWN = "shutdown"    # finish reason of a request the server ended while shutting down


class QueueFull(RuntimeError):
    """The waiting queue holds `max_waiting` sequences already; the request was not queued."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueLimits:
    max_waiting: int = DEFAULT_MAX_WAITING      # sequences submitted and not yet running
    request_timeout_s: float | None = None      # submit to last token; None: no limit

    def __post_init__(self) -> None:
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 1:
            raise ValueError(f"max_waiting={self.max_waiting!r} must be a whole number of at least 1")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s!r} must be above 0 seconds")


@dataclass(frozen=True, slots=True)
class Update:
    index: int          # which of the request's sequences
    num_output: int
    finished: bool


class RequestHandle:
    """What the server holds for one request: the engine's sequences (set on the engine thread
    before their first update) and one queue of update lists."""

    def __init__(self, loop: asyncio.AbstractEventLoop, num_seqs: int, deadline: float | None = None) -> None:
        self.loop = loop
        self.updates: asyncio.Queue[list[Update] | BaseException] = asyncio.Queue()
        self.seqs: list[Sequence | None] = [None] * num_seqs
        self.deadline = deadline    # time.monotonic() after which the engine thread ends it (TIMEOUT)


class AsyncEngine:
    def __init__(self, engine: Engine, deployment: Deployment,
                 on_step: Callable[[Engine], None] | None = None, limits: QueueLimits = QueueLimits()) -> None:
        """Steps go through `deployment.step`, which restarts a failed EP group and carries on;
        the engine object stays, its requests continue where they were."""
        self.engine = engine
        self.deployment = deployment
        self.on_step = on_step
        self.limits = limits
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[int, tuple[RequestHandle, int]] = {}    # seq_id -> (handle, index)
        self._open: dict[int, RequestHandle] = {}    # id(handle) -> handle, unfinished (engine thread)
        # Submitted, not yet taken from the inbox (both threads, under the lock): requests, sequences.
        self._lock = threading.Lock()
        self._inbox_requests = 0
        self._inbox_seqs = 0
        self._num_waiting = 0    # the scheduler's waiting sequences after the engine thread's last look
        self._stop = threading.Event()
        self.error: BaseException | None = None

    # --- event-loop side ------------------------------------------------------------------
    async def submit(self, seqs: list[tuple[list[int], SamplingParams]]) -> RequestHandle:
        """Validate (raises `RequestError`) and queue a request of one or more sequences
        (prompt ids, params); returns its handle."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        for prompt_ids, params in seqs:
            self.engine.validate_request(prompt_ids, params)
        timeout = self.limits.request_timeout_s
        handle = RequestHandle(asyncio.get_running_loop(), len(seqs),
                               None if timeout is None else time.monotonic() + timeout)
        with self._lock:
            waiting = self._num_waiting + self._inbox_seqs
            if waiting + len(seqs) > self.limits.max_waiting:
                raise QueueFull(f"the waiting queue is full ({waiting} of --max-waiting {self.limits.max_waiting} "
                                f"sequences wait; this request has {len(seqs)})")
            self._inbox_requests += 1
            self._inbox_seqs += len(seqs)
        self._inbox.put(("add", handle, seqs))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Drop a request nobody reads any more (its client went away); no update follows."""
        self._inbox.put(("abort", handle))

    def end_all(self, reason: str) -> None:
        """Finish every open request with `reason` (e.g. SHUTDOWN); each gets its final update."""
        self._inbox.put(("end_all", reason))

    @property
    def num_open(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._open) + self._inbox_requests

    def shutdown(self) -> None:
        """Make `run` return after its current step (any thread)."""
        self._stop.set()
        self._inbox.put(("wake",))

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
                    self._open[id(handle)] = handle
                except Exception as exc:  # refused after all (e.g. the cache cannot ever hold it)
                    self._abort(handle)
                    self._notify(handle, exc)
                # Counted as waiting in the scheduler before it leaves the inbox's count: the sum
                # may count it twice for a moment, never zero times.
                with self._lock:
                    self._num_waiting = len(self.engine.scheduler.waiting)
                    self._inbox_requests -= 1
                    self._inbox_seqs -= len(seqs)
            elif msg[0] == "abort":
                self._abort(msg[1])
            elif msg[0] == "end_all":
                for handle in list(self._open.values()):
                    self._end(handle, msg[1])
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
        self._open.pop(id(handle), None)

    def _end(self, handle: RequestHandle, reason: str) -> None:
        """Finish a request's unfinished sequences with `reason` (their cache is freed) and send
        their final update."""
        updates = []
        for i, seq in enumerate(handle.seqs):
            if seq is not None and not seq.is_finished:
                self.engine.abort(seq, reason)
                updates.append(Update(i, seq.num_output, True))
        self._abort(handle)
        if updates:
            self._notify(handle, updates)

    def _expire(self) -> None:
        """End every request past its deadline (TIMEOUT)."""
        now = time.monotonic()
        for handle in [h for h in self._open.values() if h.deadline is not None and h.deadline <= now]:
            self._end(handle, TIMEOUT)

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
            if all(s is not None and s.is_finished for s in handle.seqs):
                self._open.pop(id(handle), None)
            self._notify(handle, sorted(updates, key=lambda u: u.index))

    def run(self) -> None:
        """Step until `shutdown`, on the calling thread, which must be the one that built the
        deployment (raises `WrongThread` otherwise). A failing engine fails every open request
        and ends the loop (`error` says why; the server's /health then says so)."""
        self.deployment.check_thread("the server's engine loop")
        try:
            with torch.inference_mode():   # as LLM.generate steps
                while not self._stop.is_set():
                    self._drain(block=not self.engine.has_unfinished())
                    self._expire()
                    self._step()  # also after aborts, which change the batch without a step
                    with self._lock:
                        self._num_waiting = len(self.engine.scheduler.waiting)
                    if self.on_step is not None:
                        self.on_step(self.engine)
        except BaseException as exc:  # a broken engine fails every waiting request, loudly
            log.exception("engine loop failed")
            self.error = exc
            for handle in {id(h): h for h, _ in self._handles.values()}.values():
                self._notify(handle, exc)
            if not isinstance(exc, Exception):
                raise
