"""A measurement prototype, not a serving mode: the server split the way vLLM splits it, the engine
in a process of its own and the HTTP server in another, to compare with `metrale serve`'s one
process (engine loop on the builder thread, event loop on a second thread).

    python -m bench.serve.split_server --model models/tiny-glm-moe --dtype bfloat16 --port 8001

The HTTP process runs the same app (`serving.server.build_app`) over `SplitEngine`, which holds no
model and no torch work: a request's sequences are mirrors (`Sequence` objects with their own
incremental detokenizer) that the engine process's frames advance. The engine process (started
with spawn; it builds, warms up and steps the `LLM` on its main thread) reads requests from a pipe
and after every step writes one frame, a flat int32 array: per sequence that moved, its id, how
many new tokens, whether it ended (0, or 1 + the index of its finish reason) and the new token ids.
The HTTP process reads frames on its event loop (`add_reader`) and detokenizes there, so HTTP,
JSON and detokenization never share an interpreter with the step. Enough for the profile's
requests (completions and chat, n=1, no logprobs); refusals the real engine checks (context
length, grammar) are only checked in the engine process.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import threading
from array import array
from types import SimpleNamespace

REASONS = ("stop", "length", "abort", "timeout", "shutdown")


def engine_core(conn, model: str, dtype: str, max_num_seqs: int, prefix_cache: bool, enforce_eager: bool) -> None:
    """The engine process: build, warm up, then step whenever there is work; one frame a step."""
    import torch

    from serving import LLM
    llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, prefix_cache=prefix_cache, enforce_eager=enforce_eager)
    llm.deployment.warm_up()
    engine = llm.engine
    cfg = llm.engine.model_config
    conn.send(("ready", cfg.vocab_size, engine.max_model_len))
    seqs: dict[int, object] = {}     # request id -> Sequence
    sent: dict[int, int] = {}        # request id -> output tokens already framed
    with torch.inference_mode():
        while True:
            if not engine.has_unfinished():
                conn.poll(None)
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "add":
                    _, rid, prompt, params = msg
                    seqs[rid] = engine.add_request(prompt, params)
                    sent[rid] = 0
                elif msg[0] == "abort" and msg[1] in seqs:
                    engine.abort(seqs.pop(msg[1]))
                    sent.pop(msg[1], None)
                elif msg[0] == "quit":
                    llm.shutdown()
                    return
            llm.deployment.step(engine)
            frame = array("i")
            for rid, seq in list(seqs.items()):
                n = seq.num_output
                if n == sent[rid] and not seq.is_finished:
                    continue
                new = seq.token_ids[seq.prompt_len + sent[rid]:]
                end = 1 + REASONS.index(seq.finish_reason) if seq.is_finished else 0
                frame.extend((rid, len(new), end))
                frame.extend(new)
                sent[rid] = n
                if seq.is_finished:
                    del seqs[rid], sent[rid]
            if frame:
                conn.send_bytes(frame.tobytes())


class SplitEngine:
    """What `build_app` needs of an `AsyncEngine`, over the engine process's pipe."""

    def __init__(self, model: str, dtype: str, max_num_seqs: int = 64, prefix_cache: bool = True,
                 enforce_eager: bool = False) -> None:
        from pathlib import Path

        from engine.tokenizer import Tokenizer
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_core, args=(child, model, dtype, max_num_seqs, prefix_cache, enforce_eager),
                                daemon=True)
        self.proc.start()
        _, vocab, max_len = self.conn.recv()
        tokenizer = Tokenizer(model) if (Path(model) / "tokenizer.json").is_file() else None
        self.engine = SimpleNamespace(tokenizer=tokenizer, model_config=SimpleNamespace(vocab_size=vocab),
                                      max_model_len=max_len)
        self.error = None
        self._ids = iter(range(1 << 30))
        self._open: dict[int, tuple[object, object, int]] = {}    # rid -> (handle, Sequence, index)
        self._lock = threading.Lock()
        self._reader_loop = None

    @property
    def num_open(self) -> int:
        return len(self._open)

    async def submit(self, seqs, progress: bool = True):
        from engine.detokenizer import IncrementalDetokenizer
        from engine.sequence import Sequence
        from serving.async_engine import RequestHandle
        loop = asyncio.get_running_loop()
        if self._reader_loop is None:
            self._reader_loop = loop
            loop.add_reader(self.conn.fileno(), self._read)
        handle = RequestHandle(loop, len(seqs), None, progress)
        for i, (prompt, params) in enumerate(seqs):
            rid = next(self._ids)
            seq = Sequence(seq_id=rid, prompt_len=len(prompt), token_ids=list(prompt), params=params, seed=0)
            if self.engine.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.engine.tokenizer, params.stop or (), params.min_tokens)
            handle.seqs[i] = seq
            self._open[rid] = (handle, seq, i)
            self.conn.send(("add", rid, list(prompt), params))
        return handle

    def _read(self) -> None:
        """On the event loop: every frame waiting in the pipe, applied to the mirrors."""
        from serving.async_engine import Update
        from engine.sequence import SequenceStatus
        while self.conn.poll():
            frame = array("i")
            frame.frombytes(self.conn.recv_bytes())
            per: dict[int, tuple[object, list]] = {}
            at = 0
            while at < len(frame):
                rid, n, end = frame[at], frame[at + 1], frame[at + 2]
                new = frame[at + 3:at + 3 + n].tolist()
                at += 3 + n
                entry = self._open.get(rid)
                if entry is None:
                    continue
                handle, seq, index = entry
                seq.token_ids.extend(new)
                if seq.detokenizer is not None:
                    seq.detokenizer.append(new)
                    if end:
                        seq.detokenizer.finish()
                    seq.text = seq.detokenizer.text
                if end:
                    seq.finish_reason = REASONS[end - 1]
                    seq.status = SequenceStatus.FINISHED
                    del self._open[rid]
                if handle.progress or end:
                    per.setdefault(id(handle), (handle, []))[1].append(Update(index, seq.num_output, bool(end)))
            for handle, updates in per.values():
                handle.updates.put_nowait(updates)

    def abort(self, handle) -> None:
        for rid in [r for r, (h, _, _) in self._open.items() if h is handle]:
            del self._open[rid]
            self.conn.send(("abort", rid))

    def end_all(self, reason: str) -> None:
        for handle, _, _ in list(self._open.values()):
            self.abort(handle)

    def close(self) -> None:
        self.conn.send(("quit",))
        self.proc.join(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve.split_server", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default="served")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false")
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args(argv)
    import uvicorn

    from serving.server import ServerConfig, build_app
    from serving.server_metrics import ServerMetrics
    split = SplitEngine(args.model, args.dtype, args.max_num_seqs, args.prefix_cache, args.enforce_eager)
    app = build_app(split, ServerConfig(served_model_name=args.served_model_name), ServerMetrics())
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        split.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
