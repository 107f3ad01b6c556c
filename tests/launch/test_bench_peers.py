"""Peer comparisons in `metrale bench`: the vLLM child's set-up (checked through a fake `vllm`
package under the real bench/vllm_child.py), the record's schema (host, cache policy, hit counts,
prompt sets, best-against-best ratios), and ratios refused between hosts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cells import peer_ratios, record_ratios, summarize
from tests.conftest import metrale_cmd, run_env

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"

# A stand-in for vLLM's package: the real bench/vllm_child.py imports it. It logs the engine and
# sampling arguments it is given, warns the way vLLM's log does, finishes each request in one step
# with max_tokens tokens, and has counters only with stats on (as LLMEngine.get_metrics asserts).
FAKE_VLLM = '''
import json, os, sys
__version__ = "0.0-fake"
LOG = os.environ["FAKE_VLLM_LOG"]

def _log(**kw):
    with open(LOG, "a") as f:
        f.write(json.dumps(kw, default=str) + "\\n")

class EngineArgs:
    def __init__(self, **kw):
        self.kw = kw

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
        _log(sampling={k: str(v) for k, v in kw.items()})

class _Completion:
    def __init__(self, n):
        self.token_ids = [7] * n

class _Out:
    def __init__(self, rid, n, cached):
        self.request_id, self.outputs, self.finished, self.num_cached_tokens = rid, [_Completion(n)], True, cached

class _Metric:
    def __init__(self, name, value):
        self.name, self.value = name, value

class LLMEngine:
    def __init__(self, kw):
        self.kw, self.queue, self.verifies = kw, [], 0

    @classmethod
    def from_engine_args(cls, args):
        _log(engine_args=args.kw, env={k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")})
        print("WARNING 12-05 21:00:00 [cpu.py:12] fake: triton-cpu is not installed", file=sys.stderr, flush=True)
        return cls(args.kw)

    def add_request(self, rid, prompt, params):
        self.queue.append((rid, len(prompt["prompt_token_ids"]), params.kw["max_tokens"]))

    def step(self):
        out = []
        for rid, n_prompt, n in self.queue:
            k = (self.kw["speculative_config"] or {}).get("num_speculative_tokens", 0)
            self.verifies += n // (k + 1) if k else 0
            out.append(_Out(rid, n, 16 if self.kw["enable_prefix_caching"] and n_prompt >= 16 else 0))
        self.queue = []
        return out

    def get_metrics(self):
        assert not self.kw["disable_log_stats"], "Stat logging disabled"
        k = (self.kw["speculative_config"] or {}).get("num_speculative_tokens", 0)
        return [_Metric("vllm:spec_decode_num_drafts", self.verifies),
                _Metric("vllm:spec_decode_num_draft_tokens", self.verifies * k),
                _Metric("vllm:spec_decode_num_accepted_tokens", self.verifies)]
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A venv-like folder whose bin/python is this Python with the fake `vllm` first on its path;
    returns (python, log of what the fake engine and sampling params were given)."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "sampling_params.py").write_text("import enum\nclass RequestOutputKind(enum.Enum):\n"
                                            "    CUMULATIVE = 0\n    DELTA = 1\n    FINAL_ONLY = 2\n")
    log = tmp_path / "fake.log"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} FAKE_VLLM_LOG={log} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python, log


def logged(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_vllm_child_runs_stats_off_without_min_tokens_final_only(fake_vllm):
    from bench.vllm_arm import VLLMArm
    python, log = fake_vllm
    arm = VLLMArm("vllm-mtp3", str(EMBEDDED), "float32", str(python), max_num_seqs=4, threads=2)
    try:
        got = arm.run([[1] * 20, [2] * 20], concurrency=2, n=4, max_tokens=8, ep=1)
    finally:
        arm.close()
    assert arm.proc.returncode == 0
    engine = [x for x in logged(log) if "engine_args" in x][0]
    args = engine["engine_args"]
    assert args["disable_log_stats"] is True and args["enable_prefix_caching"] is False and "block_size" not in args
    assert args["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert engine["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    sampling = [x["sampling"] for x in logged(log) if "sampling" in x]
    assert sampling and all("min_tokens" not in s and s["ignore_eos"] == "True" and "FINAL_ONLY" in s["output_kind"]
                            for s in sampling)
    # Timed: no acceptance (stats off); the cell's tokens and cache lookups are the child's.
    assert got["output_tokens"] == 32 and got["accept_len"] is None and got["verifies"] == 0
    assert got["prefix_cache"] == {"policy": "off", "prompt_tokens": 80, "hit_tokens": 0}
    setup = arm.setup()
    assert setup["engine_args"] == args and setup["sampling"]["output_kind"] == "FINAL_ONLY"
    assert setup["version"] == "0.0-fake" and setup["packages"]["pytest"]
    assert "[cpu.py:12] fake: triton-cpu is not installed" in setup["warnings"]
    assert setup["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    # Acceptance from a second child with stats on, never timed.
    acc = arm.stats_pass([([[1] * 20], 1, 2)], max_tokens=8)
    assert acc == {1: {"accept_len": 2.0, "drafts_per_verify": 3.0, "verifies": 4,
                       "acceptance_from": "stats-on pass (untimed)"}}
    stats_child = [x for x in logged(log) if "engine_args" in x][1]["engine_args"]
    assert stats_child["disable_log_stats"] is False


def test_the_vllm_child_caches_prefixes_with_our_block_when_both_do(fake_vllm):
    from bench.vllm_arm import VLLMArm
    python, log = fake_vllm
    arm = VLLMArm("vllm", str(EMBEDDED), "float32", str(python), max_num_seqs=4, threads=2, prefix_cache=True,
                  block_size=32)
    try:
        got = arm.run([[1] * 20], concurrency=1, n=2, max_tokens=4, ep=1)
    finally:
        arm.close()
    args = [x for x in logged(log) if "engine_args" in x][0]["engine_args"]
    assert args["enable_prefix_caching"] is True and args["block_size"] == 32
    assert got["prefix_cache"] == {"policy": "on", "prompt_tokens": 40, "hit_tokens": 32}
    assert arm.stats_pass([([[1] * 20], 1, 1)], 4) == {}      # no speculation: no acceptance to read


def test_an_untuned_vllm_arm_runs_the_set_up_of_before(fake_vllm, monkeypatch):
    """vllm-mtp1-untuned: stats on while timed (acceptance read as it runs), min_tokens, cumulative
    outputs, nothing preloaded: the ablation that measures what the set-up is worth."""
    from bench.vllm_arm import VLLMArm
    python, log = fake_vllm
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    arm = VLLMArm("vllm-mtp1-untuned", str(EMBEDDED), "float32", str(python), max_num_seqs=4, threads=2)
    try:
        got = arm.run([[1] * 20], concurrency=1, n=2, max_tokens=8, ep=1)
    finally:
        arm.close()
    engine = [x for x in logged(log) if "engine_args" in x][0]
    assert engine["engine_args"]["disable_log_stats"] is False and engine["env"]["LD_PRELOAD"] is None
    sampling = [x["sampling"] for x in logged(log) if "sampling" in x]
    assert all(s["min_tokens"] == "8" and "output_kind" not in s for s in sampling)
    assert got["accept_len"] == 2.0 and got["verifies"] == 8
    assert arm.stats_pass([([[1] * 20], 1, 2)], 8) == {}


def test_the_vllm_child_preloads_tcmalloc_and_the_venvs_libiomp(tmp_path, monkeypatch):
    from bench import vllm_arm
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    monkeypatch.setattr(vllm_arm, "TCMALLOC", (str(tmp_path / "absent.so"), str(tmp_path / "libtcmalloc.so.4")))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "LD_PRELOAD" not in vllm_arm.child_env(str(python), 2)
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm_arm.child_env(str(python), 2)
    assert env["LD_PRELOAD"] == f"{tmp_path / 'libtcmalloc.so.4'}:{tmp_path / 'venv' / 'lib' / 'libiomp5.so'}"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["OMP_NUM_THREADS"] == "2"
    assert vllm_arm.log_warning("WARNING 12-05 21:03:11 [cpu.py:90] no tcmalloc") == "[cpu.py:90] no tcmalloc"
    assert vllm_arm.log_warning("INFO 12-05 21:03:11 [core.py:1] ready") is None
    # torch's C++ warnings lose their time stamp, so a warning given twice is kept once
    assert vllm_arm.log_warning("[W1205 20:55:51.310435207 utils.cpp:68] Warning: NUMA binding") == \
        "[utils.cpp:68] NUMA binding"


def cells_at(c, **tok_s):
    return [summarize([{"arm": arm, "concurrency": c, "tok_s": t}]) for arm, t in tok_s.items()]


def test_peer_ratios_are_best_against_best_beside_each_depth():
    cells = cells_at(1, none=100.0, k1=120.0, k3=150.0, vllm=60.0, **{"vllm-mtp1": 80.0, "vllm-mtp3": 70.0}) + \
        cells_at(16, none=400.0, k1=300.0, vllm=380.0, **{"vllm-mtp1": 420.0})
    got = {(p["concurrency"], p["pair"]): (p["ours"], p["theirs"], p["ratio"]) for p in peer_ratios(cells, "vllm")}
    assert got == {(1, "best"): ("k3", "vllm-mtp1", 1.875), (1, "best mtp"): ("k3", "vllm-mtp1", 1.875),
                   (1, "none"): ("none", "vllm", 1.667), (1, "k1"): ("k1", "vllm-mtp1", 1.5),
                   (1, "k3"): ("k3", "vllm-mtp3", 2.143),
                   (16, "best"): ("none", "vllm-mtp1", 0.952), (16, "best mtp"): ("k1", "vllm-mtp1", 0.714),
                   (16, "none"): ("none", "vllm", 1.053), (16, "k1"): ("k1", "vllm-mtp1", 0.714)}
    hf = cells_at(1, none=100.0, k1=120.0, **{"none-eager": 40.0, "hf": 30.0, "hf-eager": 10.0})
    got = {p["pair"]: (p["ours"], p["theirs"], p["ratio"]) for p in peer_ratios(hf, "hf")}
    assert got == {"best": ("k1", "hf", 4.0), "none": ("none", "hf", 3.333), "eager": ("none-eager", "hf-eager", 4.0)}


def record(cpu="AMD EPYC", flags=True, tok_s=100.0):
    cell = summarize([{"arm": "none", "concurrency": 1, "tok_s": tok_s}])
    host = {"cpu_model": cpu, "cpu_family": "25", "cpu_model_number": "17", "cpu_stepping": "1",
            "flags": {"avx512f": True, "avx512_bf16": flags}, "cpu_count": 2}
    return {"host": host, "cells": [cell]}


def test_a_ratio_between_records_of_two_hosts_is_refused(tmp_path):
    assert record_ratios(record(tok_s=120.0), record())[0]["ratio"] == 1.2
    with pytest.raises(ValueError, match="come from different hosts"):
        record_ratios(record(), record(flags=False))
    with pytest.raises(ValueError, match="record B does not name its host"):
        record_ratios(record(), {"cells": []})
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(record(tok_s=150.0)))
    b.write_text(json.dumps(record(cpu="Intel Xeon")))
    out = subprocess.run(metrale_cmd("bench", "--compare", str(a), str(b)), env=run_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "come from different hosts" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    b.write_text(json.dumps(record()))
    out = subprocess.run(metrale_cmd("bench", "--compare", str(a), str(b)), env=run_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "none c=1: 150.0 / 100.0 = 1.500" in out.stdout


def test_requests_below_the_concurrency_are_refused():
    from bench.benchmark import BenchConfig
    with pytest.raises(ValueError, match="--requests 16 is below concurrency 32"):
        BenchConfig(model=str(EMBEDDED), concurrency=(1, 16, 32), requests=16)
    with pytest.raises(ValueError, match="--prefix-cache 'on' is not one of off, both"):
        BenchConfig(model=str(EMBEDDED), prefix_cache="on")


def test_prompt_sets_are_disjoint_and_never_share_a_first_block():
    from bench.benchmark import KV_BLOCK, BenchConfig, bench_prompts
    config = BenchConfig(model=str(EMBEDDED), concurrency=(1, 16), requests=16, repeats=5)
    plan = bench_prompts(config)
    sets = [plan.warmup, *plan.cells.values()]
    assert len(plan.warmup) == 16 and set(plan.cells) == {(r, c) for r in range(5) for c in (1, 16)}
    assert all(len(ps) == 16 for ps in plan.cells.values())
    heads = [tuple(p[:KV_BLOCK]) for ps in sets for p in ps]
    assert len(heads) == 16 + 5 * 32 > 64 and len(set(heads)) == len(heads)   # past the folder's 64 prompts
    assert plan.summary()["measured"] == 160


def test_the_record_names_host_cache_policy_hits_and_peers(fake_vllm, tmp_path):
    from bench.benchmark import BenchConfig, run_bench
    python, _ = fake_vllm
    config = BenchConfig(model=str(EMBEDDED), arms=("none", "k1", "vllm", "vllm-mtp1"), concurrency=(1, 2),
                         max_tokens=4, requests=2, repeats=2, enforce_eager=True, vllm_python=str(python))
    rec = run_bench(config, json_out=tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["host"] == rec["host"]
    assert rec["host"]["cpu_count"] >= 1 and set(rec["host"]["flags"]) >= {"avx512f", "avx512_bf16", "amx_bf16"}
    assert rec["packages"]["metrale_venv"]["torch"] and rec["packages"]["vllm_venv"]["pytest"]
    assert rec["prefix_cache"]["policy"] == "off" and set(rec["prefix_cache"]["arms"].values()) == {"off"}
    assert rec["prompts"]["warmup"] == 2 and rec["prompts"]["measured"] == 2 * 2 * 2
    for cell in rec["cells"]:
        pc = cell["prefix_cache"]
        assert pc["policy"] == "off" and pc["hit_tokens"] == 0 and pc["prompt_tokens"] > 0
    setup = rec["peer_setup"]["vllm-mtp1"]
    assert setup["engine_args"]["disable_log_stats"] is True and "packages" not in setup and setup["warnings"]
    mtp = next(c for c in rec["cells"] if c["arm"] == "vllm-mtp1" and c["concurrency"] == 1)
    assert mtp["accept_len"] == 2.0 and mtp["acceptance_from"] == "stats-on pass (untimed)"
    pairs = {(p["concurrency"], p["pair"]) for p in rec["vs_vllm"]}
    assert pairs == {(c, pair) for c in (1, 2) for pair in ("best", "best mtp", "none", "k1")}


def test_our_hit_counts_are_the_prefix_caches(tmp_path):
    from bench.benchmark import BenchConfig, EngineArm
    prompt = list(range(5, 61))   # 56 tokens: three full 16-token blocks, one full 32-token block
    for policy, hits, block in (("off", 0, 16), ("both", 32, 32)):
        arm = EngineArm("none", BenchConfig(model=str(EMBEDDED), concurrency=(1,), enforce_eager=True,
                                            prefix_cache=policy))
        try:
            # With the cache on, ours runs vLLM's 32-token blocks: the same unit of reuse on both sides.
            assert arm.llm.deployment.runner.cache.block_size == block
            cell = arm.run([prompt, prompt], concurrency=1, n=2, max_tokens=2, ep=1)
        finally:
            arm.close()
        assert cell["prefix_cache"] == {"policy": "on" if policy == "both" else "off", "prompt_tokens": 112,
                                        "hit_tokens": hits}
