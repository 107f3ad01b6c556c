"""Prometheus metrics of one server: requests, latencies, the batch, the KV cache, speculation."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.engine import Engine
from speculative.metrics import MAX_POSITIONS

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self) -> None:
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
        self.preemptions = Gauge("metrale_num_preemptions", "Preemptions so far (recompute)", registry=r)
        self.prefix_queried = Counter("metrale_prefix_cache_queried_tokens",
                                      "Tokens of admitted sequences looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("metrale_prefix_cache_hit_tokens",
                                   "Of the queried tokens, those found in the prefix cache (not computed)", registry=r)
        self._prefix_seen = (0, 0)
        self.spec_drafts = Gauge("metrale_spec_decode_num_drafts", "Verifies of drafted sequences", registry=r)
        self.spec_draft_tokens = Gauge("metrale_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                       registry=r)
        self.spec_accepted = Gauge("metrale_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                   registry=r)
        self.spec_accepted_pos = Gauge("metrale_spec_decode_num_accepted_tokens_per_pos",
                                       "Drafts equal to the target's token, by draft position", ["position"],
                                       registry=r)

        self.restarts = Counter("metrale_restarts", "Restarts of the EP group after a rank died", registry=r)
        self.recovery_seconds = Gauge("metrale_last_recovery_seconds",
                                      "Seconds the last restart of the EP group took", registry=r)
        self._restarts_seen = 0

    def observe_deployment(self, sup) -> None:
        """Called on the engine thread; `sup` is the LLM's `serving.deployment.Deployment`."""
        if sup.restarts > self._restarts_seen:
            self.restarts.inc(sup.restarts - self._restarts_seen)
            self._restarts_seen = sup.restarts
        if sup.last_recovery_s is not None:
            self.recovery_seconds.set(sup.last_recovery_s)

    def observe_engine(self, engine: Engine) -> None:
        """Called on the engine thread after every step."""
        sched = engine.scheduler
        cache = engine.runner.cache
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(1 - cache.num_free_blocks / cache.num_blocks)
        self.kv_free_blocks.set(cache.num_free_blocks)
        self.kv_blocks.set(cache.num_blocks)
        self.preemptions.set(sched.num_preemptions)
        queried, hits = sched.num_prefix_queried_tokens, sched.num_prefix_hit_tokens
        self.prefix_queried.inc(queried - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = (queried, hits)
        m = engine.metrics
        self.spec_drafts.set(m.verifies)
        self.spec_draft_tokens.set(m.drafted_tokens)
        self.spec_accepted.set(m.accepted_tokens)
        for i in range(MAX_POSITIONS):
            if m.drafted_at[i]:
                self.spec_accepted_pos.labels(position=str(i)).set(m.matched_at[i])

    def render(self) -> bytes:
        return generate_latest(self.registry)
