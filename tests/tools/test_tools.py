"""One tiny run of every script in tools/, as a user runs it: a subprocess from the repository root.

Each test checks what the script promises (its printed rows or its output files, with values that
make sense) and, where the script validates its arguments, the one-line refusal of a bad one.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_env

MODEL = ROOT / "models" / "tiny-glm-moe"


def run_tool(script: str, *args: object, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / script), *map(str, args)], cwd=ROOT, env=run_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, \
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc.stdout


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def refused(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """A clean refusal: the exit code, no traceback; returns the last stderr line (the error)."""
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_ep_comm_bench_prints_layer_and_raw_comm_per_mode_and_size():
    rows = json_lines(ok(run_tool("ep/ep_comm_bench.py", "--model", MODEL, "--iters", 3, timeout=120)))
    assert [(r["mode"], r["tokens"]) for r in rows] == [(m, t) for m in ("allreduce", "alltoall") for t in (1, 16, 64)]
    for r in rows:
        assert r["raw_comm_ms"] > 0 and r["layer_comm_ms"] > 0, r
        assert r["layer_comm_ms"] <= r["layer_ms"], r  # the layer's collectives run inside its wall time
        assert r["ratio"] == pytest.approx(r["layer_comm_ms"] / r["raw_comm_ms"], rel=0.03, abs=0.02), r


def test_launcher_bench_mp_survives_a_killed_rank(tmp_path):
    out = tmp_path / "launcher.json"
    stdout = ok(run_tool("launcher_bench.py", "--model", MODEL, "--launchers", "mp", "--max-tokens", 48,
                         "--kill-at-token", 2, "--json-out", out, "--enforce-eager"))
    record = json.loads(out.read_text())
    assert record["model"] == str(MODEL)
    [row] = record["rows"]
    assert json_lines(stdout) == [row]
    assert (row["launcher"], row["ep"], row["restarts"]) == ("mp", 2, 1)
    # The request outlives the kill of rank 1: it finishes with every token it asked for.
    assert (row["finished"], row["output_tokens"]) == ("length", 48)
    assert 2 <= row["tokens_before_kill"] < 48
    assert {"ready_s", "shutdown_s"} <= set(row)
    assert 0 < row["restart_s"] <= row["kill_to_group_back_s"] <= row["kill_to_next_token_s"]


def test_launcher_bench_refuses_an_unknown_launcher():
    line = refused(run_tool("launcher_bench.py", "--launchers", "mp,slurm", timeout=60))
    assert "'slurm'" in line and "ray" in line and "mp" in line


def test_load_serve_completes_every_request_in_both_arms(tmp_path):
    out = tmp_path / "nested" / "load.json"
    stdout = ok(run_tool("load_serve.py", "--model", MODEL, "--clients", 2, "--requests", 2, "--max-tokens", 4,
                         "--arms", "none,mtp", "--json-out", out, "--enforce-eager"))
    rows = json.loads(out.read_text())
    assert json_lines(stdout) == rows
    assert [r["arm"] for r in rows] == ["none", "mtp"]
    for r in rows:
        assert (r["clients"], r["requests"], r["completed"], r["failed"], r["errors"]) == (2, 4, 4, 0, []), r
        assert r["tok_s"] > 0 and r["server_peak_rss_mib"] > 0, r
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"], r
        assert r["tpot_p50_ms"] <= r["tpot_p99_ms"], r


def test_moe_bench_times_both_expert_paths_per_dtype_and_row_count(tmp_path):
    out = tmp_path / "nested" / "moe.json"
    stdout = ok(run_tool("kernels/moe_bench.py", "--model", MODEL, "--rows", "1,4", "--dtypes", "float32,bfloat16",
                         "--repeats", 2, "--json-out", out, timeout=120))
    record = json.loads(out.read_text())  # exit 0 also says the two paths gave equal outputs
    assert record["model"] == str(MODEL) and record["threads"] >= 1
    rows = record["rows"]
    assert [(r["dtype"], r["rows"]) for r in rows] == [(d, t) for d in ("float32", "bfloat16") for t in (1, 4)]
    for r in rows:
        assert r["loop_us"] > 0 and r["grouped_us"] > 0, r
        assert r["speedup"] == pytest.approx(r["loop_us"] / r["grouped_us"], rel=0.01, abs=0.002), r
    table = stdout.splitlines()
    assert table[0].split() == ["dtype", "rows", "loop_us", "grouped_us", "speedup"] and table[-1] == f"wrote {out}"
    assert len(table) == 2 + len(rows)


def test_prefill_gemm_libs_times_both_libraries_on_the_models_shapes(tmp_path):
    out, png = tmp_path / "gemm.json", tmp_path / "gemm.png"
    ok(run_tool("kernels/prefill_gemm_libs.py", "--model", MODEL, "--rows", 32, "--rounds", 2, "--json-out", out,
                "--plot-out", png, timeout=120))
    record = json.loads(out.read_text())
    assert record["rows"] == 32 and set(record["dtypes"]) == {"float32", "bfloat16"} and png.stat().st_size > 0
    for dtype, cells in record["dtypes"].items():
        names = [c["name"] for c in cells["shapes"]]
        assert names[:2] == ["qkv", "o"] and "expert down" in names
        experts = next(c for c in cells["shapes"] if c["name"] == "expert gate/up")
        assert experts["m"] == 32 * 2 // 8 and experts["calls"] == 8        # top-2 of 8 experts: an even share
        for c in cells["shapes"]:
            assert c["mm_ms"] > 0 and c["onednn_ms"] > 0 and len(c["ratio_runs"]) == 2
            assert c["max_abs_diff"] < (1e-4 if dtype == "float32" else 0.1), c   # the same product
        layer = sum(c["mm_ms"] * c["calls"] for c in cells["shapes"]) / sum(c["onednn_ms"] * c["calls"]
                                                                         for c in cells["shapes"])
        assert cells["layer_mm_over_onednn"] == pytest.approx(layer, rel=0.01)
    assert "must be at least 1" in refused(run_tool("kernels/prefill_gemm_libs.py", "--rows", 0, timeout=60))


def test_moe_bench_refuses_a_zero_row_count():
    assert "must be at least 1" in refused(run_tool("kernels/moe_bench.py", "--rows", "0,4", timeout=60))


def test_random_checkpoint_writes_a_model_the_runtime_serves(tmp_path):
    from serving import LLM, SamplingParams
    out = tmp_path / "random"
    tokenizer = MODEL / "tokenizer.json"
    stdout = ok(run_tool("random_checkpoint.py", out, "--tokenizer", tokenizer, "--hidden", 32, "--layers", 2,
                         "--experts", 4, timeout=120))
    assert stdout.strip() == f"wrote {out}"
    cfg = json.loads((out / "config.json").read_text())
    vocab = len(json.loads(tokenizer.read_text())["model"]["vocab"])
    got = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["vocab_size"])
    assert got == (32, 2, 4, vocab)
    assert (out / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    llm = LLM(out, dtype="float32", kv_cache_tokens=256)
    [res] = llm.generate("def main(", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(res.token_ids) == 3 and all(0 <= t < vocab for t in res.token_ids)
    llm.shutdown()


def arm_rows(stdout: str) -> dict[str, list[str]]:
    """The final table of tools/run_main.py: {arm label: [tokens, seconds, tok/s, accept_len, accepted,
    step_cost, vs none]}."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("arm ")) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("("))
    width = lines[start - 1].index("tokens") - 1
    return {line[:width].strip(): line[width:].split() for line in lines[start:end]}


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_run_main_prints_the_same_text_in_every_arm():
    stdout = ok(run_tool("run_main.py", "--model", MODEL, "--max-tokens", 4, "--depths", 2, "--ep", 2,
                         "--launcher", "mp", "--enforce-eager", timeout=240))
    assert stdout.count("same text as without speculation") == 3  # k2, the default policy, EP 2
    assert "warning" not in stdout
    rows = arm_rows(stdout)
    assert list(rows) == ["no speculation", "MTP k2 (fixed)", "MTP default", "EP 2 (mp), default"]
    assert [int(r[0]) for r in rows.values()] == [4 * 4] * 4  # four prompts, four tokens each
    assert rows["no speculation"][3] == rows["no speculation"][4] == rows["no speculation"][5] == "-"
    assert all(1.0 <= float(rows[arm][3]) <= 4.0 for arm in list(rows)[1:])
    assert f"default depth policy: ladder 4:3,8:1 (from {MODEL}/metrale.toml [behavior])" in stdout
    why = stdout.strip().splitlines()[-1]
    assert why.startswith("why: MTP default "), why


def test_run_main_why_line_is_computed_from_the_run():
    """The why line's verdict and figures follow from the figures it is given: a drafting step that
    costs less than the tokens it commits pays, one that costs more does not."""
    why_line = load_tool("run_main").why_line
    # 3 drafts a verify, 2 of 3 accepted: 3.0 tokens a step; at 2.0x a plain step's cost it pays 1.5x
    pays = why_line("MTP default", 4, 0.002, 0.004, verifies=10, drafted=30, accepted=20)
    assert "67% of its 3.0 drafts a step accepted (3.00 tokens a step)" in pays
    assert "; at 4 sequences a drafting step cost 2.00x a plain decode step (4.0 ms against 2.0)" in pays
    assert "so drafting breaks even at 33% of drafts accepted and pays on this machine (1.50x expected)" in pays
    # the same acceptance at 3.5x the cost: break-even (3.5 - 1) / 3 = 83%, 3.0 / 3.5 = 0.86x
    loses = why_line("MTP default", 2, 0.002, 0.007, verifies=10, drafted=30, accepted=20)
    assert "breaks even at 83% of drafts accepted and does not pay on this machine (0.86x expected)" in loses
    # one draft a step can never pay a step that costs more than two plain ones
    never = why_line("MTP default", 1, 0.001, 0.0025, verifies=4, drafted=4, accepted=4)
    assert "breaks even beyond any acceptance and does not pay" in never
    # a drafting step no dearer than a plain one pays whatever is accepted
    cheap = why_line("MTP default", 4, 0.004, 0.004, verifies=5, drafted=15, accepted=0)
    assert "breaks even at any acceptance and does not pay" in cheap   # 1.00 tokens at 1.00x: a tie
    cheap = why_line("MTP default", 4, 0.004, 0.003, verifies=5, drafted=15, accepted=1)
    assert "breaks even at any acceptance and pays on this machine (1.60x expected)" in cheap
    with pytest.raises(ValueError, match="needs drafts"):
        why_line("MTP default", 1, 0.001, 0.002, verifies=0, drafted=0, accepted=0)


def test_run_main_compares_arms_at_the_width_both_ran_most():
    run_main = load_tool("run_main")
    plain = run_main.ArmRun("no speculation", [], 8, 1.0, 0, 0, 0, {4: [0.01] * 6, 2: [0.02] * 9})
    spec = run_main.ArmRun("MTP default", [], 8, 1.0, 4, 12, 6, {4: [0.03, 0.05, 0.04], 2: [0.1]})
    assert run_main.compared_width(plain, spec) == 4
    assert spec.step_s(4) == 0.04 and spec.accept_len == 2.5 and spec.accept_rate == 0.5
    assert run_main.compared_width(plain, run_main.ArmRun("x", [], 0, 1.0, 0, 0, 0, {})) is None


def test_run_main_refuses_a_missing_model_folder(tmp_path):
    missing = tmp_path / "nope"
    proc = run_tool("run_main.py", "--model", missing, timeout=60)
    assert refused(proc) == proc.stderr.strip() == f"make run: model folder {str(missing)!r} does not exist"


def test_step_split_splits_each_depth_into_draft_target_and_host(tmp_path):
    out = tmp_path / "split.json"
    stdout = ok(run_tool("step_split.py", "--model", MODEL, "--num-drafts", 2, "--max-tokens", 5,
                         "--prompts", 1, "--json-out", out, "--enforce-eager"))
    record = json.loads(out.read_text())
    assert record["model"] == str(MODEL)
    rows = record["rows"]
    assert stdout.splitlines()[0].split() == list(rows[0])
    assert [r["drafts"] for r in rows] == [0, 2]
    for r in rows:
        assert r["tokens"] == 5, r
        assert r["tokens_per_step"] == pytest.approx(r["tokens"] / r["steps"], abs=1e-3), r
        assert r["tok_s"] > 0 and r["target_ms"] > 0 and r["host_ms"] > 0, r
        assert r["step_ms"] == pytest.approx(r["draft_ms"] + r["target_ms"] + r["host_ms"], abs=0.03), r
        assert 1.0 <= r["tokens_per_step"] <= r["drafts"] + 1, r
    assert (rows[0]["steps"], rows[0]["draft_ms"]) == (5, 0.0)  # no speculation: one token per step
    assert rows[1]["draft_ms"] > 0


def test_train_tiny_trains_resumes_and_exports_a_servable_model(tmp_path):
    from serving import LLM, SamplingParams
    run, export = tmp_path / "run", tmp_path / "export"
    tiny = ["--out", run, "--batch", 2, "--seq", 16, "--vocab", 300, "--hidden", 32, "--layers", 2, "--heads", 2,
            "--experts", 4, "--moe-intermediate", 16, "--warmup", 1, "--fp32", "--eval-every", 100]
    first = ok(run_tool("train_tiny.py", *tiny, "--steps", 2))
    assert "tokenizer: 300 tokens" in first and "eval step 2:" in first
    second = ok(run_tool("train_tiny.py", *tiny, "--steps", 3, "--resume"))
    assert "resumed at step 2" in second and "eval step 3:" in second and "tokenizer:" not in second
    summary = json.loads(ok(run_tool("train_tiny.py", *tiny, "--export", export)).splitlines()[-1])

    meta = json.loads((export / "training.json").read_text())
    assert summary == {k: v for k, v in meta.items() if k != "history"}
    assert meta["steps"] == 3 and meta["train_tokens_seen"] == 3 * 2 * 16
    assert [h["step"] for h in meta["history"]] == [2, 3]  # the resumed run kept the first run's history
    # Barely trained: the held-out losses sit near a uniform guess over the vocabulary.
    for loss in (meta["held_out_loss"], meta["held_out_mtp_loss"]):
        assert abs(loss - math.log(300)) < 0.5, meta
    cfg = json.loads((export / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]) == \
        (300, 32, 2, 1)
    prompts = (export / "heldout_prompts.jsonl").read_text().splitlines()
    assert len(prompts) == 64 and all(json.loads(p)["prompt"].strip() for p in prompts)
    llm = LLM(export, dtype="float32", spec="mtp", num_drafts=2, kv_cache_tokens=256)  # needs the exported MTP layer
    [res] = llm.generate("def main(", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(res.token_ids) == 4
    llm.shutdown()


def test_flood(tmp_path):
    """A tiny flood (B=2: 20 requests at once) against a real server: the queue refuses with 503 and
    Retry-After, what it took completes, the server's memory stays within 25% of its idle RSS, the
    running stream never waits 3 s for a token and finishes, the server drains and exits 0."""
    proc = run_tool("flood.py", "--out", tmp_path, "--max-waiting", 2, "--running", 1, "--running-tokens", 200,
                    "--baseline-s", 0.5, "--drain-timeout", 5, "--stall-s", 3, "--rss-margin", 0.25)
    report = json.loads(ok(proc).strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "flood.json").read_text())
    assert (tmp_path / "flood.png").stat().st_size > 0
    req = report["requests"]
    assert req["refused_503"] + req["completed_200"] == 20 and req["other"] == 0
    assert req["refused_503"] >= 1 and req["refused_with_retry_after"] == req["refused_503"]
    assert req["completed_200"] >= 2                                  # at least the queue's worth
    rss = report["rss_mib"]
    assert rss["idle"] > 0 and rss["peak"] <= rss["idle"] * 1.25 + 0.1, rss     # the bound, beside its verdict
    assert rss["within_margin"] is True and rss["margin"] == 0.25
    streams = report["running_streams"]
    assert streams["max_gap_during_s"] is not None and streams["max_gap_during_s"] <= 3.0, streams
    assert streams["stalled"] is False
    assert report["running_streams"]["finish_reasons"] == ["length"]
    assert report["running_streams"]["max_gap_before_s"] > 0
    assert report["shutdown"]["exit_code"] == 0
    assert "--max-waiting 0 must be at least 1" in refused(run_tool("flood.py", "--out", tmp_path, "--max-waiting", 0))


def test_spec_bound_compares_a_tree_with_the_chain_of_its_depth():
    spec = importlib.util.spec_from_file_location("spec_bound", ROOT / "tools" / "spec_bound.py")
    bound = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bound)
    costs, layer_params = bound.costs, bound.layer_params
    out = ok(run_tool("spec_bound.py", "--model", MODEL, "--accept", "1:1.8,3:2.9", "--tree", "1,2,2:3.19"))
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["1,2,2"])
    cfg = json.loads((MODEL / "config.json").read_text())
    h = cfg["hidden_size"]
    draft = 2 * h * h + layer_params(cfg, True, cfg["num_experts_per_tok"]) + cfg["vocab_size"] * h
    gain = 3.19 / 2.9                     # the tree has the chain's 3 drafter steps and more verify rows
    bytes_ratio = gain * (costs(cfg, 4) + 3 * draft) / (costs(cfg, 6) + 3 * draft)
    assert row[2:4] == ["6", "k3"]
    assert [float(x) for x in row[4:6]] == pytest.approx([gain, bytes_ratio], abs=1e-3)
    assert bytes_ratio < gain
    missing = run_tool("spec_bound.py", "--model", MODEL, "--accept", "3:2.9", "--tree", "1,2,2,1:3.5")
    assert missing.returncode == 1 and "chain of depth 4" in missing.stderr


def test_eager_split_splits_both_arms_and_bounds_their_ratio(tmp_path):
    out = tmp_path / "split.json"
    stdout = ok(run_tool("eager_split.py", "--model", MODEL, "--dtype", "float32", "--width", 2, "--max-tokens", 4,
                         "--rounds", 1, "--json-out", out, timeout=600))
    record = json.loads(out.read_text())
    arms = record["arms"]
    assert set(arms) == {"compiled", "eager"} and "eager / compiled" in stdout
    for name, a in arms.items():
        assert a["steps"] == 4, (name, a)          # a prefill step gives the first token, then one a step
        assert 0 < a["kernels_ms"] <= a["forward_ms"] + a["logits_ms"] + 1e-3, (name, a)
        assert a["host_ms"] > 0, (name, a)
        assert a["step_ms"] == pytest.approx(a["forward_ms"] + a["logits_ms"] + a["host_ms"], abs=2e-3), (name, a)
    c, e = arms["compiled"], arms["eager"]
    free = next(b for b in record["bounds"] if b["compiled_other_forward_ms"] == 0 and b["host_share"] == 0)
    assert free["ratio"] == pytest.approx((e["kernels_ms"] + e["other_forward_ms"]) / c["kernels_ms"], rel=1e-2)
    now = next(b for b in record["bounds"] if b["host_share"] == 1)    # today's terms: the step's ratio
    assert now["ratio"] == pytest.approx(e["step_ms"] / c["step_ms"], rel=1e-2)
    assert record["ratio"] > 0


def test_eager_split_refuses_a_width_beyond_the_prompts():
    assert "fewer than --width" in refused(run_tool("eager_split.py", "--model", MODEL, "--width", 1000))


def test_random_checkpoint_fp8_writes_block_scaled_weights_the_runtime_serves(tmp_path):
    from safetensors import safe_open
    out = tmp_path / "random_fp8"
    ok(run_tool("random_checkpoint.py", out, "--tokenizer", MODEL / "tokenizer.json", "--hidden", 32, "--layers", 2,
                "--experts", 4, "--fp8", "--fp8-block", "16,16", timeout=120))
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [16, 16] and "lm_head" in q["modules_to_not_convert"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.1.mlp.experts.0.down_proj.weight")
        s = f.get_tensor("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv")
    assert w.dtype == torch.float8_e4m3fn and s.shape == (2, 1)
    gen = subprocess.run([sys.executable, "-m", "launch", "generate", "--model", str(out), "--prompt", "x",
                          "--max-tokens", "2", "--ignore-eos", "--json", "--enforce-eager", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=120, env=run_env(), cwd=ROOT)
    assert len(json_lines(ok(gen))[0]["token_ids"]) == 2
    assert "[weights: fp8 blocks 16x16 in the checkpoint, dequantized to float32 on load]" in gen.stderr
    assert "--fp8-block" in refused(run_tool("random_checkpoint.py", tmp_path / "bad", "--tokenizer",
                                             MODEL / "tokenizer.json", "--fp8-block", "128", timeout=60))


def test_tool_bench_measures_every_arm_and_grammar(tmp_path):
    out = run_tool("tool_bench.py", "--model", MODEL, "--repeats", "1", "--concurrency", "1,2", "--max-tokens", "6",
                   "--enforce-eager", "--out", tmp_path / "tg", timeout=300)
    ok(out)
    record = json.loads((tmp_path / "tg.json").read_text())
    assert {(r["spec"], r["grammar"], r["concurrency"]) for r in record["rows"]} == {
        (s, g, c) for s in ("plain", "mtp") for g in ("free", "named", "required") for c in (1, 2)}
    assert all((r["accept_len"] is not None) == (r["spec"] == "mtp") for r in record["rows"])
    assert (tmp_path / "tg.png").stat().st_size > 0
