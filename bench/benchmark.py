"""`metrale bench`: a closed-loop concurrency sweep over held-out code prompts, arms side by side.

Every arm runs the same prompts at the same concurrency levels in one run, after a warm-up at
every concurrency on prompts that are never measured, and the arms take turns (at EP 1 all are
loaded and rotate at each concurrency; at EP > 1, where a process holds one process group, each
repeat starts every arm's group in turn).
Greedy decoding with EOS ignored, so every request produces the same number of tokens in every
arm. Fixed arms (none, k1..k4, ngram, trees) speculate at every width; ladder and auto run with the
width cap a user of the model gets. Per cell: aggregate output tokens/s (median run, with min and
max over the repeats), acceptance, drafts per verify, the width cap, TTFT and TPOT percentiles,
thread count and process layout. With several request kinds (`bench.request_kinds`: plain, a JSON
schema, penalties) every arm also runs each of them, on the same loaded engine, in the same
rotation; their cells are named ARM/KIND and record the grammar's mask cost. The record (with its provenance)
goes to JSON, the curves to a PNG.

No prompt is measured twice: each (repeat, concurrency) has its own set, the same for every arm,
and no two prompts of the run share their first KV block (`bench_prompts`), so a cache can only
hit within a request. Every arm runs one cache policy (`prefix_cache`: off by default, `both` on
for ours and vLLM, both at 32-token blocks: vLLM's CPU attention takes no smaller block, and ours
follows it; no prompt shares even its first 16 tokens with another, so neither side can hit
across requests in a sweep); each cell records its prompt tokens and cache hits. The record names its host (bench.host), both venvs'
packages, and each peer's set-up.
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

from bench.cells import add_ratios, paired, peer_ratios, peer_text, summarize
from bench.corpus import heldout_chunks, spread
from bench.host import host, packages
from bench.report import check_provenance, machine, plot, print_table, provenance, verify_key_settings
from bench.request_kinds import REQUEST_KINDS, cell_name, request_params
from serving.deployment import Launcher
from serving.llm import LLM
from speculative.ladder import MAX_MTP_MAX_SEQS

# Engine arms: name -> (speculation method, most drafts per step, draft policy, confidence stop TAU).
# Arm tree drafts trees of the shape --tree-shape gives (its policy and depth come from the shape).
# Arms with the fixed policy speculate at every width (no width cap); ladder and auto take the cap
# the model folder gives (metrale.toml), as a user of the model would.
ENGINE_ARMS = {"none": ("none", 0, "fixed", None), "k1": ("mtp", 1, "fixed", None), "k2": ("mtp", 2, "fixed", None),
               "k3": ("mtp", 3, "fixed", None), "k4": ("mtp", 4, "fixed", None), "ngram": ("ngram", 3, "fixed", None),
               "ladder": ("mtp", 3, "ladder", None), "ladder+stop": ("mtp", 3, "ladder", 0.5),
               "auto": ("mtp", 3, "auto", None), "tree": ("mtp", 3, "fixed", None)}
BUILT_ARMS = (*ENGINE_ARMS, "hf")
MIN_REQUESTS = 16   # requests behind a cell by default (at least 2 x concurrency)
PREFIX_CACHE = ("off", "both")   # the cache policy of every arm: off, or on for ours and vLLM alike
KV_BLOCK = 16       # tokens per KV block of ours with the cache off: no two prompts share their first
VLLM_KV_BLOCK = 32  # both sides' with the cache on: the smallest block vLLM's CPU attention takes (32k)
WARMUP_TOKENS = 8   # output tokens per request of the warm-up (every concurrency, prompts never measured)
TREE_ARM = re.compile(r"^tree([1-4]{1,7})$")   # tree122: the shape 1,2,2, beside other shapes in one run
EAGER = "-eager"   # an engine arm named with this suffix runs without torch.compile (none-eager, k2-eager)
BATCH_INVARIANT = "-bi"   # ... with the batch-invariant kernels (none-bi, k3-bi)
EXCHANGE = "-a2a"   # ... at EP > 1 with the MoE exchange (`--moe-a2a alltoall`), not the default's choice
DP = "-dp"          # ... at EP > 1 with data-parallel attention (`--dp-attention`)
TP2 = "-tp2"        # ... with -dp: in attention groups of 2 ranks (`--attention-tp 2`)
TBO = "-tbo"        # ... with -dp (and -eager): two overlapped micro-batches a rank (`--two-batch-overlap`)
# ... a second, independent instance of the arm named without it (k3-twin beside k3): the two
# differ by nothing, so their paired ratio is the noise any other ratio of the record must beat.
TWIN = "-twin"
SUFFIXES = (EAGER, BATCH_INVARIANT, EXCHANGE, DP, TP2, TBO, TWIN)


def arm_base(arm: str) -> str:
    """The arm without its suffixes (-eager, -bi, -a2a)."""
    while arm.endswith(SUFFIXES):
        arm = arm[:-len(next(s for s in SUFFIXES if arm.endswith(s)))]
    return arm


def arm_suffixes(arm: str) -> set[str]:
    return {s for s in SUFFIXES if s in arm[len(arm_base(arm)):]}


def twin_of(arm: str) -> str:
    """The arm a `-twin` arm repeats: its name without the suffix (k3-eager-twin -> k3-eager)."""
    return arm.replace(TWIN, "", 1)


def twin_noise(cells: list[dict]) -> list[dict]:
    """Per twin cell: its paired ratio to the arm it repeats at the same concurrency and request
    kind (their runs alternate within each repeat, as every pair of arms does)."""
    out = []
    for cell in cells:
        arm, _, kind = cell["arm"].partition("/")
        if TWIN not in arm_suffixes(arm):
            continue
        name = twin_of(arm) + (f"/{kind}" if kind else "")
        base = next(x for x in cells if x["arm"] == name and x["concurrency"] == cell["concurrency"])
        if (p := paired(cell, base)) is not None:
            out.append({"concurrency": cell["concurrency"], "twin": cell["arm"], "arm": name, "paired": p})
    return out


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
    prefix_cache: str = "off"
    tree_shape: str | None = None
    enforce_eager: bool = False   # every engine arm without torch.compile
    request_kinds: tuple[str, ...] = ("plain",)
    vllm_python: str | None = None   # the peer venv's Python for the vllm arms (bench.vllm_arm)
    device: str = "auto"   # every arm, the hf one too (runtime.platform.device.resolve_device)

    def __post_init__(self) -> None:
        from bench.vllm_arm import vllm_drafts, vllm_python
        from speculative.tree_shape import TreeShape
        from runtime.platform.device import resolve_device
        resolve_device(self.device)   # a bad device or CUDA that is not there: refused before any arm loads
        for kind in self.request_kinds:
            if kind not in REQUEST_KINDS:
                raise ValueError(f"unknown bench request kind {kind!r} (one of {', '.join(REQUEST_KINDS)})")
        if "hf" in map(arm_base, self.arms) and self.request_kinds != ("plain",):
            raise ValueError("bench arm 'hf' runs the plain request kind only; drop it or --request-kinds")
        if "tree" in map(arm_base, self.arms) and self.tree_shape is None:
            raise ValueError("bench arm 'tree' needs --tree-shape, e.g. 1,2,2")
        if self.tree_shape is not None:
            TreeShape.parse(self.tree_shape)
        peers = [name for name in self.arms if vllm_drafts(name) is not None]
        if peers:
            vllm_python(self.vllm_python)
            if self.ep != 1 or self.request_kinds != ("plain",):
                raise ValueError(f"bench arms {','.join(peers)} (vLLM) run at --ep 1 with plain requests only")
        for name in self.arms:
            arm = arm_base(name)
            if vllm_drafts(name) is not None:
                continue
            if arm not in BUILT_ARMS and not TREE_ARM.match(arm):
                raise ValueError(f"unknown bench arm {name!r} (built: {', '.join(BUILT_ARMS)}, treeDIGITS, "
                                 "vllm, vllm-mtpK for K in 1..4, either + -untuned; "
                                 f"an engine arm may end in {' and '.join(SUFFIXES)})")
            if arm == "hf" and name not in ("hf", "hf" + EAGER):
                raise ValueError(f"bench arm {name!r}: hf is transformers' generate at its best, hf-eager its "
                                 "eager generate; neither is batch-invariant here")
            if TREE_ARM.match(arm):
                TreeShape.parse(arm_tree_shape(arm, None))
            if TWIN in arm_suffixes(name) and twin_of(name) not in self.arms:
                raise ValueError(f"bench arm {name!r} is the control of {twin_of(name)!r}: add that arm too "
                                 "(their paired ratio is the record's noise)")
        if self.ep < 1:
            raise ValueError(f"--ep {self.ep} must be at least 1")
        grouped = [name for name in self.arms if TP2 in arm_suffixes(name) and DP not in arm_suffixes(name)]
        if grouped:
            raise ValueError(f"bench arm {grouped[0]!r}: {TP2} groups the ranks of {DP}; add {DP}")
        exchanged = [name for name in self.arms if arm_suffixes(name) & {EXCHANGE, DP}]
        if exchanged and self.ep == 1:
            raise ValueError(f"bench arm {exchanged[0]!r}: {EXCHANGE} and {DP} pick an EP group's layout; "
                             "they need --ep 2 or more")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels {self.concurrency} must be positive")
        if max(self.concurrency) > MAX_MTP_MAX_SEQS:
            raise ValueError(f"concurrency {max(self.concurrency)} is above {MAX_MTP_MAX_SEQS}, the most sequences "
                             "that may speculate together: the fixed arms would stop speculating")
        if self.repeats < 1:
            raise ValueError(f"--repeats {self.repeats} must be at least 1")
        if self.requests is not None and self.requests < max(self.concurrency):
            raise ValueError(f"--requests {self.requests} is below concurrency {max(self.concurrency)}: no more than "
                             f"{self.requests} requests would be in flight; give at least {max(self.concurrency)}")
        if self.prefix_cache not in PREFIX_CACHE:
            raise ValueError(f"--prefix-cache {self.prefix_cache!r} is not one of {', '.join(PREFIX_CACHE)}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 2 (TPOT needs two tokens)")

    def num_requests(self, concurrency: int) -> int:
        return self.requests or max(MIN_REQUESTS, 2 * concurrency)


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
        self.tree_shape = arm_tree_shape(arm_base(name), config.tree_shape)
        spec, k, policy, tau = ENGINE_ARMS["tree" if self.tree_shape else arm_base(name)]
        self.llm = LLM(config.model, dtype=config.dtype, kv_cache_tokens=65536,
                       max_num_seqs=max(config.concurrency), spec=spec, num_drafts=k, ep=config.ep,
                       launcher=launcher, draft_policy=policy, draft_confidence_stop=tau,
                       tree_shape=self.tree_shape,
                       mtp_max_seqs=MAX_MTP_MAX_SEQS if policy == "fixed" and spec != "none" else None,
                       enforce_eager=config.enforce_eager or EAGER in arm_suffixes(name),
                       batch_invariant=True if BATCH_INVARIANT in arm_suffixes(name) else None,
                       moe_a2a="alltoall" if EXCHANGE in arm_suffixes(name) else "auto", device=config.device,
                       dp_attention=DP in arm_suffixes(name), attention_tp=2 if TP2 in arm_suffixes(name) else 1,
                       two_batch_overlap=TBO in arm_suffixes(name),
                       prefix_cache=config.prefix_cache == "both",
                       kv_block_size=VLLM_KV_BLOCK if config.prefix_cache == "both" else KV_BLOCK)
        self.prefix_policy = "on" if config.prefix_cache == "both" else "off"
        self.comm = self.llm.deployment.comm
        self.layout = {"ep": config.ep, "launcher": config.launcher if config.ep > 1 else None,
                       "ranks": [{k: r[k] for k in ("rank", "pid", "host", "node")} for r in self.llm.rank_info]}

    def close(self) -> None:
        self.llm.shutdown()

    def run(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int, ep: int,
            kind: str = "plain") -> dict:
        from speculative.metrics import AcceptanceMetrics
        engine = self.llm.engine
        grammar = engine.grammars.stats if engine.grammars is not None else None
        masks0, mask_s0 = (grammar.num_masks, grammar.mask_s + grammar.commit_s) if grammar else (0, 0.0)
        engine.metrics = AcceptanceMetrics()
        comm0 = self.comm.comm_seconds if self.comm is not None else 0.0
        wire0 = dict(self.comm.wire_bytes) if self.comm is not None else {}
        steps0 = engine.num_steps
        plans = engine.verifier.plans
        hits0, misses0 = plans.hits, plans.misses
        params = request_params(kind, max_tokens)
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
        cell = _cell(cell_name(self.name, kind), concurrency, ep, tokens, wall, ttft, tpot, requests=n, verifies=m.verifies,
                     accepted=m.accepted_tokens, p1=_round(m.positional(0)), p2_uncond=_round(m.positional(1)))
        spec = self.llm.spec
        plain = tokens - m.accepted_tokens - m.verifies     # tokens that came from plain decode rows
        cell.update(width_cap=spec.width_cap if spec.is_speculating else None,
                    drafts_per_verify=round(m.drafted_tokens / m.verifies, 3) if m.verifies else None,
                    speculated_share=round(m.verifies / (m.verifies + plain), 4) if spec.is_speculating else None,
                    threads=torch.get_num_threads(), layout=self.layout,
                    compiled=self.llm.engine.runner.compiled, device=str(self.llm.engine.runner.cache.device),
                    batch_invariant=self.llm.engine.runner.batch_invariant)
        if ep > 1:   # what the routed-expert layers of rank 0 ran (`--moe-a2a`; auto picks per layer)
            cell["moe_dispatch"] = sorted({m.dispatch_mode() for m in self.llm.engine.runner.model.modules()
                                           if hasattr(m, "dispatch_mode")})
        steps = max(1, engine.num_steps - steps0)
        cell["step_ms"] = round(1000 * wall / steps, 3)
        graphs = getattr(self.llm.engine.runner, "graphs", None)
        if graphs is not None:   # static steps (runtime.executor.static_step): buckets, CUDA graphs and their pool
            cell["static_steps"] = graphs.summary()
        cell["request_kind"] = kind
        cell["prefix_cache"] = {"policy": self.prefix_policy, "prompt_tokens": sum(s.prompt_len for s in done),
                                "hit_tokens": sum(s.num_cached_tokens for s in done)}
        if grammar is not None and grammar.num_masks > masks0:
            # Masks (consume the row's path, compute, roll back) and commits, on rank 0's step.
            mask_s = grammar.mask_s + grammar.commit_s - mask_s0
            cell["grammar_ms_per_step"] = round(1000 * mask_s / steps, 4)
            cell["grammar_us_per_mask"] = round(1e6 * mask_s / (grammar.num_masks - masks0), 2)
            cell["grammar_share_of_step"] = round(mask_s / wall, 4)
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
            # Bytes rank 0 put on the wire a step, by collective (counted from the tensors: ep.comm).
            cell["wire_bytes_per_step"] = {k: round((v - wire0.get(k, 0)) / steps)
                                           for k, v in sorted(self.comm.wire_bytes.items())}
        return cell


class HFArm:
    """transformers' `generate` on the same checkpoint, at its best unless named hf-eager: a static
    KV cache of one size for the whole run and the decode step compiled (`torch.compile`, the way
    `generate` compiles it on a GPU) where transformers says the model compiles in one graph.
    Concurrency 1 runs one request at a time (no padding); above it, batches of `concurrency`
    prompts left-padded to the longest, the padding counted in the cell. `hf-eager` (and every
    hf arm under --enforce-eager) runs eager with the dynamic cache, for reference."""

    def close(self) -> None:
        self.model = None

    def __init__(self, name: str, config: BenchConfig, threads: int, max_cache_len: int) -> None:
        import transformers
        from transformers import AutoModelForCausalLM  # every family of runtime.model.families
        from runtime.platform.device import resolve_device
        from runtime.model.weights import DTYPES
        self.name = name
        self.device = resolve_device(config.device)
        self.model = AutoModelForCausalLM.from_pretrained(config.model, dtype=DTYPES[config.dtype]).to(self.device).eval()
        self.threads = threads
        compiles = bool(getattr(self.model, "_can_compile_fullgraph", False))
        self.best = name == "hf" and not config.enforce_eager and compiles
        self.generate_kwargs: dict = {}
        if self.best:
            from transformers.generation.configuration_utils import CompileConfig
            compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="default")
            compile_config._compile_all_devices = True   # generate compiles on GPUs only unless told
            self.generate_kwargs = {"cache_implementation": "static", "max_cache_len": max_cache_len,
                                    "compile_config": compile_config}
        if name != "hf":
            why = "the eager reference arm"
        elif config.enforce_eager:
            why = "--enforce-eager"
        else:
            why = None if compiles else f"transformers does not compile {type(self.model).__name__} in one graph"
        self.setup = {"engine": "transformers", "version": transformers.__version__,
                      "cache": "static" if self.best else "dynamic", "compiled": self.best,
                      "max_cache_len": max_cache_len if self.best else None, "eager_because": why,
                      "batching": "one request at a time at concurrency 1, else left-padded batches of concurrency"}

    def run(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int, ep: int,
            kind: str = "plain") -> dict:
        # The machine's threads, whatever an EP group set for rank 0: a single process, like ours at EP 1.
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            cell = self._run(prompts, concurrency, n, max_tokens)
        finally:
            torch.set_num_threads(before)
        cell["request_kind"] = kind   # compared with the engine arms of the same request kind (bench.cells)
        return cell

    def _run(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int) -> dict:
        tokens = padding = prompt_tokens = 0
        t0 = time.perf_counter()
        for start in range(0, n, concurrency):
            batch = [prompts[i % len(prompts)] for i in range(start, min(n, start + concurrency))]
            width = max(len(p) for p in batch)
            padding += sum(width - len(p) for p in batch)
            prompt_tokens += sum(len(p) for p in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                          min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                          pad_token_id=0, **self.generate_kwargs)
            tokens += (out.shape[1] - width) * len(batch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        cell = _cell(self.name, concurrency, 1, tokens, time.perf_counter() - t0, [], [], requests=n)
        cell.update(threads=torch.get_num_threads(), layout={"ep": 1, "launcher": None, "ranks": []},
                    device=str(self.device), compiled=self.best, hf_cache=self.setup["cache"],
                    padding_tokens=padding, padding_share=round(padding / (padding + prompt_tokens), 4),
                    prefix_cache={"policy": "off", "prompt_tokens": prompt_tokens, "hit_tokens": 0})
        return cell


def build_arm(name: str, config: BenchConfig, launcher: Launcher | None, threads: int, max_cache_len: int):
    from bench.vllm_arm import VLLMArm, vllm_drafts, vllm_python
    if vllm_drafts(name) is not None:
        return VLLMArm(name, config.model, config.dtype, vllm_python(config.vllm_python), max(config.concurrency),
                       threads, prefix_cache=config.prefix_cache == "both", block_size=VLLM_KV_BLOCK)
    if arm_base(name) == "hf":
        return HFArm(name, config, threads, max_cache_len)
    return EngineArm(name, config, launcher)


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """Which prompts each run gets: `warmup` (never measured) and, per (repeat, concurrency), a set
    of its own, the same for every arm; no prompt is in two sets."""
    warmup: list[list[int]]
    cells: dict[tuple[int, int], list[list[int]]]

    @property
    def longest(self) -> int:
        return max(len(p) for ps in (self.warmup, *self.cells.values()) for p in ps)

    def summary(self) -> dict:
        sets = {f"r{r}c{c}": len(ps) for (r, c), ps in self.cells.items()}
        return {"warmup": len(self.warmup), "measured": sum(sets.values()), "per_cell": sets,
                "longest_tokens": self.longest, "disjoint": True}


def bench_prompts(config: BenchConfig) -> PromptPlan:
    """The run's prompts: the model folder's `heldout_prompts.jsonl` first, then further held-out
    chunks of the corpus (bench.corpus) as needed, each kept only when its first KV block differs
    from every earlier prompt's, cut into the warm-up set and one set per (repeat, concurrency)."""
    from engine.tokenizer import Tokenizer
    model_dir = Path(config.model)
    tok = Tokenizer(model_dir)
    levels = list(config.concurrency)
    need = max(levels) + config.repeats * sum(config.num_requests(c) for c in levels)
    path = model_dir / "heldout_prompts.jsonl"
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()] \
        if path.is_file() else []
    def candidates():
        yield from texts
        yield from spread(heldout_chunks())

    prompts, heads = [], set()
    for text in candidates():
        ids = tok.encode(text)
        head = tuple(ids[:KV_BLOCK])
        if ids and head not in heads:
            heads.add(head)
            prompts.append(ids)
            if len(prompts) == need:
                break
    if len(prompts) < need:
        raise ValueError(f"bench needs {need} distinct prompts (a warm-up set and one set per repeat and "
                         f"concurrency), the corpus gives {len(prompts)}: fewer --repeats or --requests")
    warmup, rest = prompts[:max(levels)], prompts[max(levels):]
    cells = {}
    for r in range(config.repeats):
        for c in levels:
            cells[r, c], rest = rest[:config.num_requests(c)], rest[config.num_requests(c):]
    return PromptPlan(warmup, cells)


def progress(arm: str, concurrency: int, runs: list[dict]) -> None:
    print(f"    {arm} c={concurrency} run {len(runs)}: {runs[-1]['tok_s']:.1f} tok/s", flush=True)


def kv_cache_bytes(config: BenchConfig) -> dict:
    """KV bytes per token of the model (its attention layers) in the bench dtype, and what an
    uncompressed cache in every target layer would take: they differ for multi-head latent
    attention (runtime.model.mla) and for linear-attention layers, which keep instead a state per
    sequence (`state_bytes_per_sequence`, runtime.model.linear_attention)."""
    from runtime.model.config import load_config
    from runtime.model.linear_attention import RecurrentStates
    from runtime.model.weights import DTYPES
    cfg = load_config(config.model)
    dtype = DTYPES[config.dtype]
    out = {"architecture": cfg.architecture,
           "bytes_per_token": cfg.kv_values_per_token() * dtype.itemsize * cfg.num_attention_layers,
           "uncompressed_bytes_per_token": cfg.kv_values_per_token(compressed=False) * dtype.itemsize
           * cfg.num_hidden_layers}
    if cfg.linear_layers:
        out["state_bytes_per_sequence"] = RecurrentStates(cfg, dtype=dtype, device="meta").bytes_per_sequence
    print(f"bench: {cfg.architecture}, KV cache {out['bytes_per_token']} bytes per token "
          f"(uncompressed {out['uncompressed_bytes_per_token']})"
          + (f", recurrent state {out['state_bytes_per_sequence']} bytes per sequence"
             if cfg.linear_layers else ""), flush=True)
    return out


def run_bench(config: BenchConfig, json_out: Path | None = None, plot_out: Path | None = None,
              launcher: Launcher | None = None) -> dict:
    """Run the sweep; `launcher` starts each arm's worker ranks at EP > 1 (the CLI passes the one
    `--launcher` names)."""
    start = provenance()
    threads = torch.get_num_threads()
    plan = bench_prompts(config)
    max_cache_len = plan.longest + config.max_tokens
    print(f"bench: {plan.summary()['measured']} held-out prompts measured (a set per repeat and concurrency) and "
          f"{len(plan.warmup)} for the warm-up, arms {','.join(config.arms)}, request kinds "
          f"{','.join(config.request_kinds)}, concurrency "
          f"{','.join(map(str, config.concurrency))}, {config.max_tokens} tokens per request, "
          f"{config.repeats} repeat(s), prefix cache {config.prefix_cache}, "
          f"commit {start['git_sha']}{' (dirty)' if start['dirty'] else ''}", flush=True)
    names = [cell_name(a, k) for a in config.arms for k in config.request_kinds]
    runs: dict[tuple[str, int], list[dict]] = {(name, c): [] for name in names for c in config.concurrency}
    setups: dict[str, dict] = {}
    acceptance: dict[str, dict[int, dict]] = {}

    def measure(name: str, arm, c: int, r: int) -> None:
        for kind in config.request_kinds:
            cell = cell_name(name, kind)
            runs[cell, c].append(arm.run(plan.cells[r, c], c, config.num_requests(c), config.max_tokens, config.ep,
                                         kind))
            progress(cell, c, runs[cell, c])

    def warm(arm) -> None:
        # At every concurrency, on prompts never measured: each width's compiled graphs, not the first cell's.
        for c in config.concurrency:
            for kind in config.request_kinds:
                arm.run(plan.warmup[:c], c, c, min(WARMUP_TOKENS, config.max_tokens), config.ep, kind)

    def note(name: str, arm) -> None:
        if hasattr(arm, "setup"):
            setups[name] = arm.setup() if callable(arm.setup) else arm.setup

    arm_names = list(config.arms)
    if config.ep == 1:
        # Every arm loaded first; at each concurrency the arms take turns, in a rotating order.
        arms = {name: build_arm(name, config, launcher, threads, max_cache_len) for name in arm_names}
        try:
            for arm in arms.values():
                warm(arm)
            for c in config.concurrency:
                for r in range(config.repeats):
                    for name in arm_names[r % len(arm_names):] + arm_names[:r % len(arm_names)]:
                        measure(name, arms[name], c, r)
        finally:
            for arm in arms.values():
                arm.close()
        for name, arm in arms.items():
            if hasattr(arm, "stats_pass"):   # vLLM's acceptance, from an untimed child with stats on
                acceptance[name] = arm.stats_pass([(plan.cells[0, c], c, config.num_requests(c))
                                                   for c in config.concurrency], config.max_tokens)
            note(name, arm)
    else:
        # A process holds one process group: each repeat starts every arm's group in turn (start-up
        # is not measured), so the arms take turns across repeats as they do at EP 1.
        for r in range(config.repeats):
            for name in arm_names[r % len(arm_names):] + arm_names[:r % len(arm_names)]:
                arm = build_arm(name, config, launcher, threads, max_cache_len)
                try:
                    warm(arm)
                    for c in config.concurrency:
                        measure(name, arm, c, r)
                finally:
                    arm.close()
                note(name, arm)
    end = check_provenance(start)
    cells = [summarize(runs[name, c]) for c in config.concurrency for name in names]
    for cell in cells:
        if (got := acceptance.get(cell["arm"], {}).get(cell["concurrency"])) is not None:
            cell.update(got)
    add_ratios(cells, names[0])
    peers = {peer: peer_ratios(cells, peer) for peer in ("vllm", "hf")}
    noise = twin_noise(cells)
    ours = packages()
    theirs = next((s.pop("packages") for s in setups.values() if s.get("packages")), None)
    for s in setups.values():
        s.pop("packages", None)
    record = {"model": str(config.model), **start, **end, "kv_cache": kv_cache_bytes(config),
              "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "host": host(),
              "packages": {"metrale_venv": ours, **({"vllm_venv": theirs} if theirs else {})},
              "params": asdict(config), "verify_key": verify_key_settings(),
              "prefix_cache": {"policy": config.prefix_cache,
                               "block_size": VLLM_KV_BLOCK if config.prefix_cache == "both" else KV_BLOCK,
                               "vllm_block_size": VLLM_KV_BLOCK if config.prefix_cache == "both" else None,
                               "arms": {name: ("on" if config.prefix_cache == "both" and arm_base(name) != "hf"
                                               else "off") for name in arm_names}},
              "prompts": plan.summary(), "peer_setup": setups, "cells": cells}
    for peer, ratios in peers.items():
        if ratios:
            record[f"vs_{peer}"] = ratios
    if noise:
        record["twin_noise"] = noise
    print_table(cells)
    for n in noise:
        p = n["paired"]
        print(f"noise c={n['concurrency']}: {n['twin']} / {n['arm']} (the same arm twice) paired {p['median']:.3f} "
              f"[{p['range'][0]:.2f}-{p['range'][1]:.2f}]")
    for peer, ratios in peers.items():
        for p in ratios:
            print(peer_text(peer, p))
    for name, s in setups.items():
        for w in s.get("warnings", []):
            print(f"{name} warned: {w}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {json_out}")
    if plot_out:
        plot(cells, plot_out, f"{Path(config.model).name} ({config.dtype}, ep {config.ep}, "
                              f"{config.repeats} repeat(s), prefix cache {config.prefix_cache})")
        print(f"wrote {plot_out}")
    return record
