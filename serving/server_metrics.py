"""Prometheus metrics of one server: requests, latencies, the batch, the KV cache, speculation.

Counts are counters (`_total`), levels gauges. Where a series carries a vLLM name after the
`metrale_` prefix (`spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`, `num_preemptions`, `avg_generation_throughput_toks_per_s`,
`spec_decode_draft_acceptance_rate`) it has vLLM's meaning; a series whose meaning differs has a
name of its own (`spec_decode_draft_matches_per_pos`: a draft equal to the target's token,
whatever came before it).
"""
from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.engine import Engine
from speculative.metrics import MAX_POSITIONS

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
THROUGHPUT_WINDOW_S = 10.0
EXPERT_LOADS_PERIOD_S = 1.0


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()   # the engine thread writes what /metrics reads
        r = self.registry = CollectorRegistry()
        self.requests = Counter("metrale_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter("metrale_requests_rejected",
                                "Requests refused with a 4xx, or ended with a 503/504 (queue full, draining, "
                                "timeout, shutdown)", ["status"], registry=r)
        self.prompt_tokens = Counter("metrale_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("metrale_generation_tokens", "Output tokens sent", registry=r)
        self.latency = Histogram("metrale_request_latency_seconds", "Arrival to last token", registry=r,
                                 buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram("metrale_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.running = Gauge("metrale_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("metrale_num_requests_waiting", "Sequences waiting for admission", registry=r)
        self.kv_usage = Gauge("metrale_kv_cache_usage_ratio", "Share of KV cache blocks in use", registry=r)
        self.kv_free_blocks = Gauge("metrale_kv_cache_free_blocks",
                                    "KV cache blocks no sequence holds (equal to the total when idle)", registry=r)
        self.kv_blocks = Gauge("metrale_kv_cache_blocks", "KV cache blocks in all", registry=r)
        self.preemptions = Counter("metrale_num_preemptions", "Preemptions (by recompute)", registry=r)
        self.prefix_queried = Counter("metrale_prefix_cache_queried_tokens",
                                      "Tokens of admitted sequences looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("metrale_prefix_cache_hit_tokens",
                                   "Of the queried tokens, those found in the prefix cache (not computed)", registry=r)
        self.spec_drafts = Counter("metrale_spec_decode_num_drafts",
                                   "Verifies of drafted sequences (vLLM: number of spec decoding drafts)", registry=r)
        self.spec_draft_tokens = Counter("metrale_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         registry=r)
        self.spec_accepted = Counter("metrale_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     registry=r)
        self.spec_accepted_pos = Counter("metrale_spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted tokens by draft position, as vLLM counts them: a draft at "
                                         "position i counts when it and every draft before it were accepted (the "
                                         "positions sum to num_accepted_tokens)", ["position"], registry=r)
        self.spec_matched_pos = Counter("metrale_spec_decode_draft_matches_per_pos",
                                        "Drafts equal to the target's token at their position, whatever the "
                                        "drafts before them (p_i of docs/design.md 5.8)", ["position"], registry=r)
        self.spec_acceptance_rate = Gauge("metrale_spec_decode_draft_acceptance_rate",
                                          "Accepted draft tokens / draft tokens proposed, since start", registry=r)
        self.spec_acceptance_rate.set_function(self._acceptance_rate)
        self.spec_mean_acceptance_length = Gauge(
            "metrale_spec_decode_mean_acceptance_length",
            "Tokens a verify of a drafted sequence commits on average, 1 + accepted / verifies, since start",
            registry=r)
        self.spec_mean_acceptance_length.set_function(self._mean_acceptance_length)
        self.throughput = Gauge("metrale_avg_generation_throughput_toks_per_s",
                                f"Output tokens committed per second over the last {THROUGHPUT_WINDOW_S:g} s "
                                "(every sequence, as each step commits them)", registry=r)
        self.throughput.set_function(self._throughput)
        self._samples: deque[tuple[float, int]] = deque()   # (time, tokens committed so far) per step
        self._seen: dict[tuple, float] = {}
        self._spec_totals = (0, 0, 0)                           # verifies, draft tokens, accepted tokens

        self.restarts = Counter("metrale_restarts", "Restarts of the EP group after a rank died", registry=r)
        self.recovery_seconds = Gauge("metrale_last_recovery_seconds",
                                      "Seconds the last restart of the EP group took", registry=r)
        self._restarts_seen = 0

        self.expert_tokens = Counter("metrale_expert_routed_tokens",
                                     "Tokens routed to each routed expert, by MoE layer (model order, the MTP "
                                     "layer last): EPLB's load counters (--eplb-redundant-experts)",
                                     ["layer", "expert"], registry=r)
        self.eplb_placements = Counter("metrale_eplb_placements", "Live re-placements of the experts (EPLB)",
                                       registry=r)
        self._experts_read = -float("inf")

    def observe_deployment(self, sup) -> None:
        """Called on the engine thread; `sup` is the LLM's `serving.deployment.Deployment`."""
        if sup.restarts > self._restarts_seen:
            self.restarts.inc(sup.restarts - self._restarts_seen)
            self._restarts_seen = sup.restarts
        if sup.last_recovery_s is not None:
            self.recovery_seconds.set(sup.last_recovery_s)

    def observe_experts(self, sup, idle: bool) -> None:
        """Called on the engine thread after every step; `sup` the Deployment. EPLB's per-expert
        load counters live on the device: they are read (one host sync) at most every
        EXPERT_LOADS_PERIOD_S while serving, and whenever the engine is `idle`."""
        runner = sup.runner
        if not getattr(runner, "eplb", False):
            return
        now = time.monotonic()
        if not idle and now - self._experts_read < EXPERT_LOADS_PERIOD_S:
            return
        self._experts_read = now
        for layer, row in enumerate(runner.expert_loads()):
            for expert, total in enumerate(row):
                self._advance(self.expert_tokens.labels(layer=str(layer), expert=str(expert)),
                              ("expert", layer, expert), total)
        self._advance(self.eplb_placements, ("eplb",), runner.placements)

    def observe_engine(self, engine: Engine) -> None:
        """Called on the engine thread after every step."""
        sched = engine.scheduler
        cache = engine.runner.cache
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(1 - cache.num_free_blocks / cache.total_blocks)
        self.kv_free_blocks.set(cache.num_free_blocks)
        self.kv_blocks.set(cache.total_blocks)
        self._advance(self.preemptions, ("preemptions",), sched.num_preemptions)
        self._advance(self.prefix_queried, ("prefix_queried",), sched.num_prefix_queried_tokens)
        self._advance(self.prefix_hits, ("prefix_hits",), sched.num_prefix_hit_tokens)
        m = engine.metrics
        self._advance(self.spec_drafts, ("drafts",), m.verifies)
        self._advance(self.spec_draft_tokens, ("draft_tokens",), m.drafted_tokens)
        self._advance(self.spec_accepted, ("accepted",), m.accepted_tokens)
        for i in range(MAX_POSITIONS):
            if m.drafted_at[i]:
                pos = str(i)
                self._advance(self.spec_accepted_pos.labels(position=pos), ("accepted_at", i), m.accepted_at[i])
                self._advance(self.spec_matched_pos.labels(position=pos), ("matched_at", i), m.matched_at[i])
        with self._lock:
            self._spec_totals = (m.verifies, m.drafted_tokens, m.accepted_tokens)
            now = time.monotonic()
            self._samples.append((now, engine.num_generated_tokens))
            while len(self._samples) > 2 and self._samples[1][0] < now - THROUGHPUT_WINDOW_S:
                self._samples.popleft()

    def _advance(self, counter, key: tuple, total: int) -> None:
        """Move a counter to the engine's running `total` (its count since start)."""
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
        self._seen[key] = total

    def _acceptance_rate(self) -> float:
        with self._lock:
            _, drafted, accepted = self._spec_totals
        return accepted / drafted if drafted else 0.0

    def _mean_acceptance_length(self) -> float:
        with self._lock:
            verifies, _, accepted = self._spec_totals
        return 1 + accepted / verifies if verifies else 0.0

    def _throughput(self) -> float:
        """Tokens committed in the window ending now, per second of it (0 once the window is idle)."""
        now = time.monotonic()
        with self._lock:
            samples = [(t, n) for t, n in self._samples if t >= now - THROUGHPUT_WINDOW_S]
            before = [(t, n) for t, n in self._samples if t < now - THROUGHPUT_WINDOW_S]
        if not samples:
            return 0.0
        start_n = before[-1][1] if before else samples[0][1]
        span = now - before[-1][0] if before else now - samples[0][0]
        span = min(span, THROUGHPUT_WINDOW_S)
        return (samples[-1][1] - start_n) / span if span > 0 else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
