"""How `metrale serve` ends: a graceful drain on SIGTERM (or Ctrl-C), then uvicorn's exit.

The first SIGTERM/SIGINT stops intake at once (every new request is a 503 with Retry-After and
/health says "draining", while the port stays open so clients get an answer rather than a refused
connection), lets the open requests finish for up to `drain_timeout_s`, ends the rest with finish
reason `shutdown` (their clients get a final event or an error saying so), and only then lets
uvicorn close its connections and return, so the caller can stop every EP rank and exit 0.
A second signal during the drain exits at once.

Threads: uvicorn's event loop runs on a thread of its own ("metrale-http"); the calling thread,
the one that built and warmed up the engine, runs the engine loop (`AsyncEngine.run`) and takes
the signals, so all torch work stays on one thread (serving.async_engine).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from serving.async_engine import SHUTDOWN, AsyncEngine

log = logging.getLogger("metrale.server")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
SHUTDOWN_SIGNALS = {signal.SIGINT, signal.SIGTERM}
END_GRACE_S = 5.0   # after ending the open requests: how long their last events may take to go out


class Drain:
    """The drain's state, read by the request handlers (`is_draining`) and run once by `run`."""

    def __init__(self, aengine: AsyncEngine, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"drain timeout {timeout_s!r} must be at least 0 seconds")
        self.aengine = aengine
        self.timeout_s = timeout_s
        self.is_draining = False
        self.num_ended = 0      # requests still open at the deadline, ended with SHUTDOWN
        self.poll: Callable[[], None] = lambda: None   # handles a signal delivered and not yet read (run_server)

    def check(self) -> bool:
        """Whether the server drains, a signal delivered before this call included: a request
        that arrives after the SIGTERM is refused even if the event loop has not read it yet."""
        self.poll()
        return self.is_draining

    async def run(self) -> None:
        """Wait for the open requests (up to the timeout), then end what is left."""
        self.is_draining = True
        open_now = self.aengine.num_open
        say(f"draining: no new requests; {open_now} open, up to {self.timeout_s:g} s to finish")
        deadline = time.monotonic() + self.timeout_s
        while self.aengine.num_open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.num_ended = self.aengine.num_open
        if self.num_ended:
            say(f"drain timeout: ending {self.num_ended} unfinished request(s) (finish reason {SHUTDOWN!r})")
            self.aengine.end_all(SHUTDOWN)
            grace = time.monotonic() + END_GRACE_S
            while self.aengine.num_open and time.monotonic() < grace:
                await asyncio.sleep(0.05)


def say(message: str) -> None:
    print(f"metrale serve: {message}", file=sys.stderr, flush=True)


class DrainingServer(uvicorn.Server):
    """uvicorn, with its exit signal turned into a drain first."""

    def __init__(self, config: uvicorn.Config, drain: Drain, signals: socket.socket | None = None) -> None:
        """`signals`: the read end of the process's signal wakeup fd (`run_server`); each byte is
        a signal number, handled on the event loop's thread as soon as it arrives."""
        super().__init__(config)
        self.drain = drain
        self.signals = signals
        self._drain_loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._announced = 0     # signals handled while pending, whose wakeup byte is still to come

    async def serve(self, sockets=None) -> None:
        self._drain_loop = asyncio.get_running_loop()
        if self.signals is not None:
            self._drain_loop.add_reader(self.signals.fileno(), self.read_signals)
        await super().serve(sockets)

    def read_signals(self) -> None:
        """Handle the signals delivered since the last call (the wakeup fd), and one still on its
        way to the main thread (pending: kill() returned, the main thread has not taken it yet;
        this thread blocks both signals, so it sees them pending), counted so its delivery later
        is not taken for a second signal."""
        got = b""
        if self.signals is not None:
            try:
                got = self.signals.recv(64)
            except (BlockingIOError, InterruptedError):
                pass
        for sig in got:
            if self._announced:
                self._announced -= 1
                continue
            self.handle_exit(sig, None)
        if not self.drain.is_draining and self._drain_loop is not None:
            pending = signal.sigpending() & SHUTDOWN_SIGNALS
            if pending:
                self._announced += 1
                self.handle_exit(min(pending), None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The signal is deliberately not recorded the way uvicorn records it: uvicorn raises a
        # recorded signal again once it has shut down, and the process would die of it (exit
        # -15) after a clean drain.
        if self.drain.is_draining or self._drain_loop is None:
            say("second signal: exiting now")
            self.should_exit = self.force_exit = True
            return
        self.drain.is_draining = True     # before anything else runs: new requests see it at once
        self._drain_loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            try:
                await self.drain.run()
            finally:
                self.should_exit = True
        self._drain_task = asyncio.ensure_future(drain_then_exit())


def run_server(app, *, host: str, port: int, drain: Drain) -> None:
    """Serve `app` until a signal's drain (or a second signal) ends it: uvicorn on an HTTP thread,
    the engine loop (`drain.aengine.run`) on this one, which must be the main thread (signals)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = DrainingServer(config, drain)
    aengine = drain.aengine
    failed: list[BaseException] = []

    def http() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, SHUTDOWN_SIGNALS)   # delivered to the main thread
        try:
            server.run()
        except BaseException as exc:   # uvicorn exits (SystemExit) when it cannot bind the port
            failed.append(exc)
        finally:
            aengine.shutdown()

    # Python runs signal handlers on the main thread only, between bytecodes, so a handler there
    # would wait out a step; the wakeup fd is written at delivery, and the event loop's thread
    # reads it and starts the drain at once (new requests see it before the next step ends).
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    server.signals = reader
    drain.poll = server.read_signals
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, _noted) for sig in SHUTDOWN_SIGNALS}
    thread = threading.Thread(target=http, name="metrale-http", daemon=True)
    try:
        thread.start()
        aengine.run()
        while thread.is_alive():    # the engine failed: keep answering (/health says so) until a signal
            thread.join(timeout=0.5)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()
    if failed:
        raise failed[0]


def _noted(sig: int, frame: FrameType | None) -> None:
    """The Python-level handler of SIGINT/SIGTERM while serving: nothing (the wakeup fd carries
    the signal to the event loop's thread), but not the default, which would end the process."""
