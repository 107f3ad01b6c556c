"""`metrale bench`: a closed-loop concurrency sweep over held-out code prompts, arms side by side.

Every arm runs the same prompts at the same concurrency levels in one process and one run, after a
warm-up that is not measured. Greedy decoding with EOS ignored, so every request produces the same
number of tokens in every arm. Per cell: aggregate output tokens/s, acceptance (for arms that
speculate), TTFT and TPOT percentiles. The record goes to JSON, the curves to a PNG.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.report import git_sha, machine, plot, print_table, verify_key_settings
from bench.corpus import heldout_prompts
from runtime.sampler import SamplingParams
from serving.deployment import Launcher
from serving.llm import LLM

# Engine arms: name -> (speculation method, most drafts per step, draft policy, confidence stop TAU).
# Arm tree drafts trees of the shape --tree-shape gives (its policy and depth come from the shape).
ENGINE_ARMS = {"none": ("none", 0, "fixed", None), "k1": ("mtp", 1, "fixed", None), "k2": ("mtp", 2, "fixed", None),
               "k3": ("mtp", 3, "fixed", None), "k4": ("mtp", 4, "fixed", None), "ngram": ("ngram", 3, "fixed", None),
               "ladder": ("mtp", 3, "ladder", None), "ladder+stop": ("mtp", 3, "ladder", 0.5),
               "auto": ("mtp", 3, "auto", None), "tree": ("mtp", 3, "fixed", None)}
BUILT_ARMS = (*ENGINE_ARMS, "hf")
TREE_ARM = re.compile(r"^tree([1-4]{1,7})$")   # tree122: the shape 1,2,2, beside other shapes in one run


def arm_tree_shape(arm: str, default: str | None) -> str | None:
    """The tree shape an arm drafts: `tree` takes --tree-shape, `treeDIGITS` its own digits."""
    m = TREE_ARM.match(arm)
    if m:
        return ",".join(m.group(1))
    return default if arm == "tree" else None


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    model: str
    dtype: str = "float32"
    arms: tuple[str, ...] = ("none",)
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    ep: int = 1
    launcher: str = "mp"   # how ep > 1 starts its ranks; start-up is not part of any figure
    max_tokens: int = 128
    requests: int | None = None
    repeats: int = 1       # runs per cell; the arms take turns, and the median run is the cell
    quick: bool = False
    num_prompts: int = 64
    tree_shape: str | None = None

    def __post_init__(self) -> None:
        from speculative.tree_shape import TreeShape
        if "tree" in self.arms and self.tree_shape is None:
            raise ValueError("bench arm 'tree' needs --tree-shape, e.g. 1,2,2")
        if self.tree_shape is not None:
            TreeShape.parse(self.tree_shape)
        for arm in self.arms:
            if arm not in BUILT_ARMS and not TREE_ARM.match(arm):
                raise ValueError(f"unknown bench arm {arm!r} (built: {', '.join(BUILT_ARMS)}, treeDIGITS)")
            if TREE_ARM.match(arm):
                TreeShape.parse(arm_tree_shape(arm, None))
        if self.ep < 1:
            raise ValueError(f"--ep {self.ep} must be at least 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels {self.concurrency} must be positive")
        if self.repeats < 1:
            raise ValueError(f"--repeats {self.repeats} must be at least 1")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 2 (TPOT needs two tokens)")

    def num_requests(self, concurrency: int) -> int:
        return self.requests or max(4, 2 * concurrency)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    idx = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[idx]


def _cell(arm: str, concurrency: int, ep: int, tokens: int, wall: float, ttft: list[float],
          tpot: list[float], verifies: int = 0, accepted: int = 0, p1: float | None = None,
          p2_uncond: float | None = None, requests: int = 0) -> dict:
    return {"arm": arm, "concurrency": concurrency, "ep": ep, "requests": requests, "output_tokens": tokens,
            "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "accept_len": round(1 + accepted / verifies, 3) if verifies else None,
            "p1": p1, "p2_uncond": p2_uncond, "verifies": verifies,
            "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p90_ms": _ms(percentile(ttft, 90)),
            "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p90_ms": _ms(percentile(tpot, 90))}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


class EngineArm:
    """Our engine, closed loop: `concurrency` requests in flight, a new one joins as one ends."""

    def __init__(self, name: str, config: BenchConfig, launcher: Launcher | None = None) -> None:
        self.name = name
        self.tree_shape = arm_tree_shape(name, config.tree_shape)
        spec, k, policy, tau = ENGINE_ARMS["tree" if self.tree_shape else name]
        self.llm = LLM(config.model, dtype=config.dtype, kv_cache_tokens=65536,
                       max_num_seqs=max(config.concurrency), spec=spec, num_drafts=k, ep=config.ep,
                       launcher=launcher, draft_policy=policy, draft_confidence_stop=tau,
                       tree_shape=self.tree_shape)
        self.comm = self.llm.deployment.comm

    def close(self) -> None:
        self.llm.shutdown()

    def run(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int, ep: int) -> dict:
        from speculative.metrics import AcceptanceMetrics
        engine = self.llm.engine
        engine.metrics = AcceptanceMetrics()
        comm0 = self.comm.comm_seconds if self.comm is not None else 0.0
        steps0 = engine.num_steps
        plans = engine.verifier.plans
        hits0, misses0 = plans.hits, plans.misses
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        inflight, done = [], []
        submitted = 0
        t0 = time.perf_counter()
        while len(done) < n:
            while len(inflight) < concurrency and submitted < n:
                inflight.append(engine.add_request(prompts[submitted % len(prompts)], params))
                submitted += 1
            self.llm.step()
            still = []
            for seq in inflight:
                (done if seq.is_finished else still).append(seq)
            inflight = still
        wall = time.perf_counter() - t0
        ttft = [s.first_token_time - s.arrival_time for s in done]
        tpot = [(s.finish_time - s.first_token_time) / (s.num_output - 1) for s in done if s.num_output > 1]
        tokens = sum(s.num_output for s in done)
        m = engine.metrics
        cell = _cell(self.name, concurrency, ep, tokens, wall, ttft, tpot, requests=n, verifies=m.verifies,
                     accepted=m.accepted_tokens, p1=_round(m.positional(0)), p2_uncond=_round(m.positional(1)))
        steps = max(1, engine.num_steps - steps0)
        cell["step_ms"] = round(1000 * wall / steps, 3)
        if self.tree_shape is not None:
            cell["tree_shape"] = self.tree_shape
            cell["hedges_taken"] = m.hedges_taken
        hits, misses = plans.hits - hits0, plans.misses - misses0
        cell["plan_cache"] = {"hits": hits, "misses": misses,
                              "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None}
        if self.comm is not None:  # rank 0's time inside collectives (includes waiting for peers)
            comm_s = self.comm.comm_seconds - comm0
            cell["comm_ms_per_step"] = round(1000 * comm_s / steps, 3)
            cell["compute_ms_per_step"] = round(1000 * (wall - comm_s) / steps, 3)
        return cell


class HFArm:
    """transformers' `generate` on the same checkpoint: static batches of `concurrency` prompts."""

    def close(self) -> None:
        self.model = None

    def __init__(self, config: BenchConfig) -> None:
        from transformers import Glm4MoeForCausalLM
        from runtime.weights import DTYPES
        self.model = Glm4MoeForCausalLM.from_pretrained(config.model, dtype=DTYPES[config.dtype]).eval()

    def run(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int, ep: int) -> dict:
        tokens = 0
        t0 = time.perf_counter()
        for start in range(0, n, concurrency):
            batch = [prompts[i % len(prompts)] for i in range(start, min(n, start + concurrency))]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)
            tokens += (out.shape[1] - width) * len(batch)
        return _cell("hf", concurrency, 1, tokens, time.perf_counter() - t0, [], [], requests=n)


def build_arm(name: str, config: BenchConfig, launcher: Launcher | None = None):
    return HFArm(config) if name == "hf" else EngineArm(name, config, launcher)


def bench_prompts(config: BenchConfig) -> list[list[int]]:
    from runtime.tokenizer import Tokenizer
    model_dir = Path(config.model)
    tok = Tokenizer(model_dir)
    path = model_dir / "heldout_prompts.jsonl"
    if path.is_file():
        texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    else:
        texts = heldout_prompts(config.num_prompts)
    return [tok.encode(t) for t in texts[:config.num_prompts]]


def progress(arm: str, concurrency: int, runs: list[dict]) -> None:
    print(f"    {arm} c={concurrency} run {len(runs)}: {runs[-1]['tok_s']:.1f} tok/s", flush=True)


def median_cell(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one for an even count), with every
    run's tokens/s beside it."""
    ranked = sorted(runs, key=lambda c: c["tok_s"])
    cell = dict(ranked[(len(ranked) - 1) // 2])
    cell["tok_s_runs"] = [r["tok_s"] for r in runs]
    return cell


def run_bench(config: BenchConfig, json_out: Path | None = None, plot_out: Path | None = None,
              launcher: Launcher | None = None) -> dict:
    """Run the sweep; `launcher` starts each arm's worker ranks at EP > 1 (the CLI passes the one
    `--launcher` names)."""
    prompts = bench_prompts(config)
    print(f"bench: {len(prompts)} held-out prompts, arms {','.join(config.arms)}, concurrency "
          f"{','.join(map(str, config.concurrency))}, {config.max_tokens} tokens per request", flush=True)
    # At EP 1 every arm is loaded first and the arms take turns at each concurrency (in a rotating
    # order when repeated), so a slow spell of the machine falls on all of them alike. At EP > 1 a
    # process holds one process group, so the arms run one after another, each with its group.
    runs: dict[tuple[str, int], list[dict]] = {(a, c): [] for a in config.arms for c in config.concurrency}
    if config.ep == 1:
        arms = {name: build_arm(name, config, launcher) for name in config.arms}
        try:
            for arm in arms.values():
                arm.run(prompts[:2], 2, 2, 4, config.ep)  # warm-up, not recorded
            for c in config.concurrency:
                for r in range(config.repeats):
                    names = list(arms)
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        runs[name, c].append(arms[name].run(prompts, c, config.num_requests(c), config.max_tokens,
                                                            config.ep))
                        progress(name, c, runs[name, c])
        finally:
            for arm in arms.values():
                arm.close()
    else:
        for name in config.arms:
            arm = build_arm(name, config, launcher)
            try:
                arm.run(prompts[:2], 2, 2, 4, config.ep)
                for c in config.concurrency:
                    for _ in range(config.repeats):
                        runs[name, c].append(arm.run(prompts, c, config.num_requests(c), config.max_tokens, config.ep))
                        progress(name, c, runs[name, c])
            finally:
                arm.close()
    print("cells (median run):", flush=True)
    cells: list[dict] = []
    for c in config.concurrency:
        for name in config.arms:
            cell = median_cell(runs[name, c])
            cells.append(cell)
            rate = cell.get("plan_cache", {}).get("hit_rate")
            print(f"  {name:>11} c={c:<3} {cell['tok_s']:9.1f} tok/s  accept_len {cell['accept_len']}  "
                  f"plan hits {rate}" + (f"  runs {cell['tok_s_runs']}" if config.repeats > 1 else ""), flush=True)
    base = {c["concurrency"]: c["tok_s"] for c in cells if c["arm"] == config.arms[0]}
    fixed = [a for a in ("none", "k1", "k2", "k3") if a in config.arms]
    for c in cells:
        c["tok_s_ratio_vs_" + config.arms[0]] = round(c["tok_s"] / base[c["concurrency"]], 3)
        if fixed and c["arm"] not in fixed:  # DESIGN §5.3's comparison: the best fixed depth here
            best = max(x["tok_s"] for x in cells if x["concurrency"] == c["concurrency"] and x["arm"] in fixed)
            c["tok_s_ratio_vs_best_fixed"] = round(c["tok_s"] / best, 3)
    record = {"model": str(config.model), "git_sha": git_sha(),
              "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "params": asdict(config), "verify_key": verify_key_settings(), "cells": cells}
    print_table(cells)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {json_out}")
    if plot_out:
        plot(cells, plot_out, f"{Path(config.model).name} ({config.dtype}, ep {config.ep})")
        print(f"wrote {plot_out}")
    return record
