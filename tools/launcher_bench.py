"""Start-up cost of the ray and mp launchers, and the seconds from a killed rank to serving again.

    python tools/launcher_bench.py --model models/tiny-glm-moe --ep 2 --json-out bench/records/launcher.json

Per launcher: seconds to a ready LLM (group started, shards loaded, handshake done), then one
request of --max-tokens tokens during which rank 1 is SIGKILLed after --kill-after seconds:
seconds from the kill until the group is back (restart done) and until the request's next token.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def drain(llm, errors: list[BaseException]) -> None:
    """Step the engine (supervised: a dead group restarts) until every request has finished."""
    try:
        while llm.engine.has_unfinished():
            llm.step()
    except BaseException as exc:  # reported by the caller after join
        errors.append(exc)


def measure(launcher: str, model: str, ep: int, max_tokens: int, kill_after: float,
            kill_at_token: int | None = None, enforce_eager: bool = False) -> dict:
    from launch import launcher_for
    from launch.ray_group import RayOptions
    from runtime.sample.sampler import SamplingParams
    from serving.llm import LLM

    ray_options = RayOptions(temp_dir=tempfile.mkdtemp(prefix="mray", dir="/tmp")) if launcher == "ray" else None
    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", ep=ep, kv_cache_tokens=4096,
              launcher=launcher_for(launcher, ray_options=ray_options), enforce_eager=enforce_eager)
    ready = time.perf_counter() - t0
    deployment = llm.deployment
    seq = llm.engine.add_request(llm.encode("def main("), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    errors: list[BaseException] = []
    runner = threading.Thread(target=drain, args=(llm, errors))
    runner.start()
    if kill_at_token is None:
        time.sleep(kill_after)
    else:
        while seq.num_output < kill_at_token and runner.is_alive():
            time.sleep(0.001)
    if not runner.is_alive():
        llm.shutdown(graceful=not errors)
        if errors:
            raise errors[0]
        raise SystemExit(f"{launcher}: the request finished ({seq.num_output} tokens) before the kill; "
                         "raise --max-tokens or kill earlier")
    before = seq.num_output
    victim = llm.rank_info[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    killed = time.perf_counter()
    while deployment.last_recovery_s is None and runner.is_alive():
        time.sleep(0.005)
    back = time.perf_counter() - killed
    grown = seq.num_output
    while seq.num_output == grown and runner.is_alive():
        time.sleep(0.005)
    first_token = time.perf_counter() - killed
    runner.join()
    if errors:
        llm.shutdown(graceful=False)
        raise errors[0]
    out = {"launcher": launcher, "ep": ep, "ready_s": round(ready, 3), "tokens_before_kill": before,
           "kill_to_group_back_s": round(back, 3), "kill_to_next_token_s": round(first_token, 3),
           "restart_s": round(deployment.last_recovery_s, 3), "restarts": deployment.restarts,
           "finished": seq.finish_reason, "output_tokens": seq.num_output}
    t1 = time.perf_counter()
    llm.shutdown()
    out["shutdown_s"] = round(time.perf_counter() - t1, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--launchers", default="mp,ray")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--kill-after", type=float, default=1.5)
    ap.add_argument("--kill-at-token", type=int, default=None,
                    help="kill rank 1 once the request has this many tokens (instead of --kill-after seconds)")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="run the eager step (no compile: a quick check; the speeds are not the served ones)")
    args = ap.parse_args()
    from launch import LAUNCHERS
    launchers = [name.strip() for name in args.launchers.split(",")]
    bad = [name for name in launchers if name not in LAUNCHERS]
    if bad:
        ap.error(f"--launchers {args.launchers!r}: {', '.join(map(repr, bad))} is not one of {', '.join(LAUNCHERS)}")
    if args.ep < 2:
        ap.error(f"--ep {args.ep}: killing rank 1 needs at least 2 ranks")
    if args.kill_at_token is not None and not 1 <= args.kill_at_token < args.max_tokens:
        ap.error(f"--kill-at-token {args.kill_at_token}: expected 1..{args.max_tokens - 1} (below --max-tokens)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = []
    for launcher in launchers:
        row = measure(launcher, args.model, args.ep, args.max_tokens, args.kill_after, args.kill_at_token, args.enforce_eager)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
