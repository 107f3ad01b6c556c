"""`metrale bench --workload serve-vs-vllm`: both servers under one cache policy, vLLM's client
called without its CLI, ratios paired run by run (no vLLM needed for these)."""
from __future__ import annotations

import pytest

from bench.serve.vs_vllm import (CLIENT, ServeVsVLLMConfig, metrale_command, metrale_env, summarize, vllm_command,
                                 vllm_env)
from tests.conftest import ROOT

MODEL = str(ROOT / "models" / "tiny-glm-moe")


def config(tmp_path, **kw) -> ServeVsVLLMConfig:
    python = tmp_path / "python"
    python.write_text("")
    return ServeVsVLLMConfig(**{"model": MODEL, "vllm_python": str(python), **kw})


def test_both_servers_run_one_cache_policy(tmp_path):
    off = config(tmp_path)
    assert "--no-prefix-cache" in metrale_command(off, 1) and "--no-enable-prefix-caching" in vllm_command(off, 1)
    both = config(tmp_path, prefix_cache="both")
    ours, theirs = metrale_command(both, 1), vllm_command(both, 1)
    assert "--no-prefix-cache" not in ours and "--enable-prefix-caching" in theirs
    assert ours[ours.index("--block-size") + 1] == theirs[theirs.index("--block-size") + 1] == "32"
    env = vllm_env(off)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert "vllm.benchmarks.serve import add_cli_args, main" in CLIENT


def test_bad_config_refused(tmp_path):
    with pytest.raises(ValueError, match="off or both"):
        config(tmp_path, prefix_cache="ours")
    with pytest.raises(ValueError, match="no such file"):
        ServeVsVLLMConfig(model=MODEL, vllm_python=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="no config.json"):
        config(tmp_path, model=str(tmp_path))


def test_ratios_are_paired_run_by_run(tmp_path):
    cfg = config(tmp_path, concurrency=(1,), repeats=3)

    def run(tok_s, ttft, tpot):
        return {"requests": 16, "tok_s": tok_s, "ttft_p50_ms": ttft, "tpot_p50_ms": tpot}
    runs = {("metrale", 1): [run(100, 10, 2.0), run(90, 10, 2.0), run(120, 8, 1.0)],
            ("vllm", 1): [run(100, 20, 4.0), run(100, 10, 2.0), run(100, 10, 2.0)]}
    cells, ratios = summarize(runs, cfg)
    assert [(c["server"], c["tok_s"]) for c in cells] == [("metrale", 100), ("vllm", 100)]
    (r,) = ratios
    assert (r["tok_s_ratio"], r["tok_s_ratio_min"], r["tok_s_ratio_max"]) == (1.0, 0.9, 1.2)
    assert (r["ttft_p50_ratio"], r["ttft_p50_ratio_min"], r["ttft_p50_ratio_max"]) == (1.25, 1.0, 2.0)
    assert r["tpot_p50_ratio"] == 2.0


def test_arms_are_more_servers_of_ours_with_their_options_and_environment(tmp_path):
    cfg = config(tmp_path, arms=("b512:--max-num-batched-tokens 512", "spin:GOMP_SPINCOUNT=1000 --max-num-seqs 16"))
    assert cfg.servers() == ["metrale", "metrale-b512", "metrale-spin", "vllm"]
    base = metrale_command(cfg, 1)
    assert metrale_command(cfg, 1, "metrale-b512") == base + ["--max-num-batched-tokens", "512"]
    assert metrale_command(cfg, 1, "metrale-spin") == base + ["--max-num-seqs", "16"]
    assert metrale_env(cfg, "metrale") is None and metrale_env(cfg, "metrale-b512") is None
    assert metrale_env(cfg, "metrale-spin")["GOMP_SPINCOUNT"] == "1000"
    assert config(tmp_path, arms=("b512:x",), vllm=False).servers() == ["metrale", "metrale-b512"]
    for bad in (("b512",), ("a:x", "a:y"), (":x",), ("a b:x",)):
        with pytest.raises(ValueError, match="NAME:ARGS"):
            config(tmp_path, arms=bad)
    with pytest.raises(ValueError, match="arms to compare"):
        config(tmp_path, vllm=False)


def test_arms_get_ratios_against_vllm_and_the_default_server(tmp_path):
    cfg = config(tmp_path, concurrency=(16,), repeats=2, arms=("b:x",))

    def run(tok_s, ttft):
        return {"requests": 64, "tok_s": tok_s, "ttft_p50_ms": ttft, "tpot_p50_ms": 1.0}
    runs = {("metrale", 16): [run(100, 10), run(100, 10)], ("metrale-b", 16): [run(110, 8), run(130, 10)],
            ("vllm", 16): [run(50, 10), run(100, 10)]}
    cells, ratios = summarize(runs, cfg)
    assert [c["server"] for c in cells] == ["metrale", "metrale-b", "vllm"]
    got = {(r["server"], r["against"]): (r["tok_s_ratio_min"], r["tok_s_ratio_max"], r["ttft_p50_ratio"])
           for r in ratios}
    assert got == {("metrale", "vllm"): (1.0, 2.0, 1.0), ("metrale-b", "vllm"): (1.3, 2.2, 1.125),
                   ("metrale-b", "metrale"): (1.1, 1.3, 1.125)}
