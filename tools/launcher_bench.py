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


def measure(launcher: str, model: str, ep: int, max_tokens: int, kill_after: float) -> dict:
    from launch.ray_group import RayOptions
    from serving.llm import LLM
    from runtime.sampler import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, dtype="float32", ep=ep, kv_cache_tokens=4096, launcher=launcher,
              ray_options=RayOptions(temp_dir=tempfile.mkdtemp(prefix="mray", dir="/tmp")))
    ready = time.perf_counter() - t0
    seq = llm.engine.add_request(llm.encode("def main("), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    runner = threading.Thread(target=llm._run_to_completion)
    runner.start()
    time.sleep(kill_after)
    before = seq.num_output
    victim = llm.rank_info[1]["pid"]
    os.kill(victim, signal.SIGKILL)
    killed = time.perf_counter()
    while llm.supervisor.last_recovery_s is None and runner.is_alive():
        time.sleep(0.005)
    back = time.perf_counter() - killed
    grown = seq.num_output
    while seq.num_output == grown and runner.is_alive():
        time.sleep(0.005)
    first_token = time.perf_counter() - killed
    runner.join()
    out = {"launcher": launcher, "ep": ep, "ready_s": round(ready, 3), "tokens_before_kill": before,
           "kill_to_group_back_s": round(back, 3), "kill_to_next_token_s": round(first_token, 3),
           "restart_s": round(llm.supervisor.last_recovery_s, 3), "restarts": llm.supervisor.restarts,
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
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = []
    for launcher in args.launchers.split(","):
        row = measure(launcher.strip(), args.model, args.ep, args.max_tokens, args.kill_after)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
