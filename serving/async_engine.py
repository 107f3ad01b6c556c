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
output tokens each sequence has now and whether it ended; a request that asked for no progress
(`progress=False`: a non-streaming one) hears only of sequences that ended. Committed tokens (and
their logprobs) are only ever appended, so a reader that slices `token_ids[:n]` with the `n` it
was told always sees a consistent prefix.

Hand-offs: each wakeup of the event loop's thread takes a core from the step's OpenMP team for a
moment (2 cores: one of its two threads), so the engine thread wakes a loop at most once per batch
of updates. Updates go to a per-loop outbox; only the update that finds the outbox empty schedules
a delivery (`call_soon_threadsafe`), which empties it into the requests' queues. A loop that has
not yet run its delivery gets later updates in the same one (docs/design.md §6).

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
# `on_step` (the server's metrics) runs at most this often while steps go on, and always after a
# step that ended a sequence and before the loop idles: on every step it cost a lone request a
# measurable share of its step (design §2, the engine thread's hand-offs).
ON_STEP_INTERVAL_S = 0.05
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

    def __init__(self, loop: asyncio.AbstractEventLoop, num_seqs: int, deadline: float | None = None,
                 progress: bool = True) -> None:
        self.loop = loop
        self.progress = progress    # False: only updates of sequences that ended (a non-streaming reader)
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
        # Updates not yet delivered, per event loop (engine thread appends, the loop empties).
        self._out_lock = threading.Lock()
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, list[Update] | BaseException]]] = {}
        self.num_handoffs = 0    # deliveries scheduled on an event loop (each one a wakeup of its thread)

    # --- event-loop side ------------------------------------------------------------------
    async def submit(self, seqs: list[tuple[list[int], SamplingParams]], progress: bool = True) -> RequestHandle:
        """Validate (raises `RequestError`) and queue a request of one or more sequences
        (prompt ids, params); returns its handle. `progress=False`: its queue hears only of
        sequences that ended (one wakeup per sequence instead of one per step)."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        for prompt_ids, params in seqs:
            self.engine.validate_request(prompt_ids, params)
        timeout = self.limits.request_timeout_s
        handle = RequestHandle(asyncio.get_running_loop(), len(seqs),
                               None if timeout is None else time.monotonic() + timeout, progress)
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
        self._notify_all([(handle, item)])

    def _notify_all(self, items: list[tuple[RequestHandle, list[Update] | BaseException]]) -> None:
        """Queue each (handle, item) in its loop's outbox; wake a loop only if its outbox was empty
        (no delivery pending there). All of a step's updates go in one call, so the loop cannot
        run a delivery half way through them."""
        wake = []
        with self._out_lock:
            for handle, item in items:
                box = self._outbox.setdefault(handle.loop, [])
                if not box:
                    wake.append(handle.loop)
                box.append((handle, item))
        for loop in wake:
            self.num_handoffs += 1
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:    # the loop closed: nobody reads these updates any more
                with self._out_lock:
                    self._outbox.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`'s thread: every update queued for it since the last delivery, in order."""
        with self._out_lock:
            items = self._outbox.pop(loop, [])
        for handle, item in items:
            handle.updates.put_nowait(item)

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

    def _step(self) -> tuple[bool, list]:
        """One step; returns whether a sequence ended (or the group restarted) and the updates to
        deliver (`_notify_all`), which the loop sends after the metrics of a step that ended a
        sequence are observed, so a client that heard its request end reads them in /metrics."""
        outcome = self.deployment.step(self.engine)
        if outcome.recovered:
            # A restart: tell every request where it stands (a step that failed half way may
            # have committed tokens or finished requests nobody has heard of yet).
            done = [h.seqs[i] for h, i in self._handles.values()]
        else:
            done = outcome.done
        per_handle: dict[int, tuple[RequestHandle, list[Update]]] = {}
        out = []
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
            if not handle.progress:
                updates = [u for u in updates if u.finished]
            if updates:
                out.append((handle, sorted(updates, key=lambda u: u.index)))
        return outcome.recovered or any(seq.is_finished for seq in done), out

    def run(self) -> None:
        """Step until `shutdown`, on the calling thread, which must be the one that built the
        deployment (raises `WrongThread` otherwise). A failing engine fails every open request
        and ends the loop (`error` says why; the server's /health then says so)."""
        self.deployment.check_thread("the server's engine loop")
        try:
            observed = 0.0
            with torch.inference_mode():   # as LLM.generate steps
                while not self._stop.is_set():
                    self._drain(block=not self.engine.has_unfinished())
                    self._expire()
                    ended, out = self._step()  # also after aborts, which change the batch without a step
                    with self._lock:
                        self._num_waiting = len(self.engine.scheduler.waiting)
                    if self.on_step is not None:
                        now = time.monotonic()
                        if ended or now - observed >= ON_STEP_INTERVAL_S or not self.engine.has_unfinished():
                            self.on_step(self.engine)
                            observed = now
                    if out:
                        self._notify_all(out)
        except BaseException as exc:  # a broken engine fails every waiting request, loudly
            log.exception("engine loop failed")
            self.error = exc
            self._notify_all([(handle, exc) for handle in {id(h): h for h, _ in self._handles.values()}.values()])
            if not isinstance(exc, Exception):
                raise
