"""`metrale bench`: arms side by side, repeated runs taking turns, a JSON record and a PNG plot."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.cells import add_ratios, paired_text, ratio_text, summarize
from tests.conftest import metrale_cmd, run_env

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"


def test_a_cell_is_its_median_run_with_the_spread():
    runs = [{"tok_s": 30.0, "x": "a"}, {"tok_s": 10.0, "x": "b"}, {"tok_s": 20.0, "x": "c"}]
    cell = summarize(runs)
    assert cell["x"] == "c" and cell["tok_s_runs"] == [30.0, 10.0, 20.0]
    assert (cell["tok_s_min"], cell["tok_s_median"], cell["tok_s_max"], cell["repeats"]) == (10.0, 20.0, 30.0, 3)
    assert summarize(runs[:2])["x"] == "b"  # even count: the lower middle run


def cell(arm, tok_s, lo, hi, c=1):
    return {"arm": arm, "concurrency": c, "tok_s": tok_s, "tok_s_min": lo, "tok_s_max": hi}


def test_ratios_against_every_fixed_arm_with_ties():
    cells = [cell("none", 100.0, 95.0, 104.0), cell("k1", 120.0, 118.0, 121.0), cell("k2", 110.0, 100.0, 130.0),
             cell("k4", 125.0, 124.0, 126.0), cell("ladder", 131.0, 127.0, 140.0), cell("auto", 126.0, 122.0, 128.0),
             cell("none", 50.0, 50.0, 50.0, c=4), cell("ladder", 40.0, 39.0, 41.0, c=4)]
    add_ratios(cells, "none")
    by = {(x["arm"], x["concurrency"]): x for x in cells}
    # k4 is the best fixed arm at concurrency 1 (125 > 120 > 110 > 100), not k1..k3 only.
    assert by["ladder", 1]["best_fixed_arm"] == "k4" and by["ladder", 1]["tok_s_ratio_vs_best_fixed"] == 1.048
    assert by["ladder", 1]["tok_s_ratio_vs_best_fixed_range"] == [round(127 / 126, 3), round(140 / 124, 3)]
    assert by["ladder", 1]["tie_with_best_fixed"] is False and ratio_text(by["ladder", 1]) == "1.048 vs k4"
    assert by["auto", 1]["tie_with_best_fixed"] is True and ratio_text(by["auto", 1]) == "tie vs k4"
    assert by["k4", 1]["best_fixed_arm"] == "k1"          # a fixed arm against the best of the others
    assert by["k2", 1]["tok_s_ratio_vs_none"] == 1.1 and by["none", 1]["tok_s_ratio_vs_none"] == 1.0
    assert by["ladder", 4]["tok_s_ratio_vs_best_fixed"] == 0.8 and "best_fixed_arm" not in by["none", 4]


def test_paired_ratios_divide_runs_of_the_same_repeat():
    """The machine slows down between repeats: every run of k1 beats the same repeat's run of none,
    yet their ranges overlap (a tie by ranges); the paired ratio sees k1 ahead in every repeat."""
    cells = [summarize([{"arm": "none", "concurrency": 1, "tok_s": t} for t in (100.0, 70.0, 90.0)]),
             summarize([{"arm": "k1", "concurrency": 1, "tok_s": t} for t in (110.0, 77.0, 95.0)]),
             summarize([{"arm": "ladder", "concurrency": 1, "tok_s": t} for t in (90.0, 80.0)])]
    add_ratios(cells, "none")
    none, k1, ladder = cells
    assert k1["tie_with_best_fixed"] is True
    assert k1["tok_s_paired_vs_best_fixed"] == {"median": 1.1, "range": [round(95 / 90, 3), 1.1], "consistent": True}
    assert paired_text(k1) == "1.100 [1.06-1.10]*"
    assert none["tok_s_paired_vs_best_fixed"]["range"] == [round(100 / 110, 3), round(90 / 95, 3)]
    # Runs that straddle 1 are not consistent; a cell with another count of repeats has no pairing.
    mixed = summarize([{"arm": "k2", "concurrency": 1, "tok_s": t} for t in (105.0, 65.0, 91.0)])
    add_ratios(cells + [mixed], "none")
    assert mixed["tok_s_paired_vs_none"]["consistent"] is False
    assert "tok_s_paired_vs_best_fixed" not in ladder and paired_text(ladder) == "-"


def test_bench_writes_record_and_plot(tmp_path):
    import shutil
    model = tmp_path / "m"
    shutil.copytree(EMBEDDED, model)
    (model / "metrale.toml").write_text("[behavior]\nmtp_max_seqs = 1\n")   # ladder: speculation off at 2
    # The arms run eager (`--enforce-eager`; a compile costs ~30 s on a cold cache): the record's
    # fields are what this test checks. test_request_kinds_run_side_by_side_on_each_arm runs a
    # compiled arm, and the "-eager" suffix is checked there too.
    out = subprocess.run(metrale_cmd("bench", "--model", str(model), "--arms", "none,none-eager,k2-eager,ladder-eager,hf,none-twin",
                                     "--enforce-eager",
                                     "--concurrency", "1,2", "--max-tokens", "6", "--requests", "2", "--repeats", "2",
                                     "--json-out", str(tmp_path / "b.json"), "--plot-out", str(tmp_path / "b.png")),
                         env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["git_sha"] and isinstance(record["dirty"], bool) and "bench --model" in record["command"]
    assert record["git_sha_at_end"] == record["git_sha"] and record["machine"]["cpu_count"] >= 1
    cells = {(c["arm"], c["concurrency"]): c for c in record["cells"]}
    assert set(cells) == {(a, c) for a in ("none", "none-eager", "k2-eager", "ladder-eager", "hf", "none-twin")
                          for c in (1, 2)}
    for (arm, c), x in cells.items():
        assert len(x["tok_s_runs"]) == 2 and x["tok_s"] in x["tok_s_runs"]
        assert x["tok_s_min"] <= x["tok_s"] <= x["tok_s_max"] and x["requests"] == 2
        assert x["output_tokens"] == 2 * 6 and x["threads"] >= 1 and x["layout"]["ep"] == 1
        fixed = {k: v for k, v in cells.items() if k[1] == c and k[0] in ("none", "none-eager", "k2-eager") and k[0] != arm}
        best = max(fixed.values(), key=lambda v: v["tok_s"])
        assert abs(x["tok_s_ratio_vs_best_fixed"] - x["tok_s"] / best["tok_s"]) < 2e-3
    # The fixed arm speculates at every width; the ladder takes the folder's cap of 1.
    assert cells["k2-eager", 2]["width_cap"] == 128 and cells["k2-eager", 2]["verifies"] > 0
    assert cells["k2-eager", 1]["drafts_per_verify"] > 1.0
    assert cells["ladder-eager", 2]["width_cap"] == 1 and cells["ladder-eager", 2]["verifies"] == 0
    assert cells["ladder-eager", 1]["verifies"] > 0 and cells["none", 1]["width_cap"] is None
    assert cells["hf", 1]["accept_len"] is None and cells["hf", 2]["output_tokens"] == 12
    assert cells["none", 1]["compiled"] is False and cells["none-eager", 1]["compiled"] is False
    assert "vs best fixed" in out.stdout and "[" in out.stdout   # the table shows ratios and spreads
    # The twin is a control, never the best fixed arm: its paired ratio to `none` is the noise.
    assert all(x.get("best_fixed_arm") != "none-twin" for x in cells.values())
    noise = {n["concurrency"]: n for n in record["twin_noise"]}
    assert set(noise) == {1, 2} and all(n["twin"] == "none-twin" and n["arm"] == "none" for n in noise.values())
    runs = [a / b for a, b in zip(cells["none-twin", 1]["tok_s_runs"], cells["none", 1]["tok_s_runs"])]
    assert noise[1]["paired"]["range"] == [round(min(runs), 3), round(max(runs), 3)]
    assert "noise c=1: none-twin / none (the same arm twice) paired" in out.stdout
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_bench_refuses_unknown_arm():
    out = subprocess.run(metrale_cmd("bench", "--model", str(EMBEDDED), "--arms", "none,k9"), env=run_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "k9" in out.stderr and "Traceback" not in out.stderr


def test_tree_arms_name_their_shape():
    import pytest

    from bench.benchmark import BenchConfig, arm_tree_shape
    assert arm_tree_shape("tree122", None) == "1,2,2"
    assert arm_tree_shape("tree", "2,2") == "2,2" and arm_tree_shape("k3", "2,2") is None
    BenchConfig(model="m", arms=("k3", "tree122", "tree3211"))
    with pytest.raises(ValueError, match="at most 7"):
        BenchConfig(model="m", arms=("tree4444",))
    with pytest.raises(ValueError, match="unknown bench arm 'tree5'"):
        BenchConfig(model="m", arms=("tree5",))
    BenchConfig(model="m", arms=("none-eager", "k2-eager", "tree122-eager", "k3-bi", "none-eager-bi"))
    BenchConfig(model="m", arms=("k3", "k3-twin", "none-eager", "none-eager-twin"))
    with pytest.raises(ValueError, match="'k2-twin' is the control of 'k2': add that arm too"):
        BenchConfig(model="m", arms=("k3", "k2-twin"))
    BenchConfig(model="m", arms=("none", "none-a2a", "k3-bi-a2a", "k3-dp"), ep=2)
    with pytest.raises(ValueError, match="'none-a2a': -a2a and -dp pick an EP group's layout"):
        BenchConfig(model="m", arms=("none", "none-a2a"))
    with pytest.raises(ValueError, match="'k3-dp': -a2a and -dp pick an EP group's layout"):
        BenchConfig(model="m", arms=("k3-dp",))
    BenchConfig(model="m", arms=("k3-dp-tp2",), ep=2)
    with pytest.raises(ValueError, match="'k3-tp2': -tp2 groups the ranks of -dp; add -dp"):
        BenchConfig(model="m", arms=("k3-tp2",), ep=2)
    from bench.benchmark import arm_base, arm_suffixes
    assert arm_base("k3-bi-eager") == "k3" and arm_suffixes("k3-bi-eager") == {"-bi", "-eager"}
    assert arm_base("none-bi") == "none" and arm_suffixes("k3") == set()
    for bad in ("hf-bi", "hf-twin", "hf-eager-bi"):
        with pytest.raises(ValueError, match="hf is transformers' generate at its best, hf-eager its eager"):
            BenchConfig(model="m", arms=(bad,))
    assert BenchConfig(model="m", arms=("hf", "hf-eager")).arms == ("hf", "hf-eager")


def test_bench_at_ep2_runs_each_arm_with_its_own_group(tmp_path):
    out = subprocess.run(metrale_cmd("bench", "--model", str(EMBEDDED), "--arms", "none,k1-a2a", "--ep", "2",
                                     "--enforce-eager",   # 4 group starts; a compile each would add ~1 min
                                     "--concurrency", "1", "--max-tokens", "4", "--requests", "2", "--repeats", "2",
                                     "--json-out", str(tmp_path / "b.json")),
                         env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cells = json.loads((tmp_path / "b.json").read_text())["cells"]
    assert [(c["arm"], c["ep"], c["output_tokens"]) for c in cells] == [("none", 2, 8), ("k1-a2a", 2, 8)]
    # The default dispatch all-reduces (two experts a token); -a2a takes the exchange.
    assert [c["moe_dispatch"] for c in cells] == [["allreduce"], ["alltoall"]]
    assert all(len(c["layout"]["ranks"]) == 2 and c["layout"]["launcher"] == "mp" for c in cells)


def test_request_kinds_run_side_by_side_on_each_arm(tmp_path):
    from bench.benchmark import BenchConfig, run_bench
    config = BenchConfig(model=str(EMBEDDED), arms=("none-eager", "k2-bi"), request_kinds=("plain", "json", "penalties"),
                         concurrency=(2,), max_tokens=6, requests=2)
    record = run_bench(config, json_out=tmp_path / "w.json")
    cells = {c["arm"]: c for c in record["cells"]}
    assert set(cells) == {f"{a}{w}" for a in ("none-eager", "k2-bi") for w in ("", "/json", "/penalties")}
    assert cells["k2-bi"]["batch_invariant"] and cells["k2-bi"]["compiled"]
    assert not cells["none-eager"]["batch_invariant"] and not cells["none-eager"]["compiled"]
    assert all(c["output_tokens"] == 12 for c in cells.values())      # every request kind runs to max_tokens
    assert cells["k2-bi/json"]["grammar_us_per_mask"] > 0 and cells["k2-bi/json"]["verifies"] > 0
    assert [cells[f"k2-bi{w}"]["request_kind"] for w in ("", "/json", "/penalties")] == ["plain", "json", "penalties"]
    assert "grammar_ms_per_step" not in cells["k2-bi/penalties"]
    assert cells["k2-bi/json"]["best_fixed_arm"] == "none-eager/json"  # compared within its request kind
    with pytest.raises(ValueError, match="request kind 'xml'"):
        BenchConfig(model="m", request_kinds=("xml",))


def test_chat_bench_runs_both_arms_through_the_server(tmp_path):
    """The chat workload, tiny: later turns find their history in the cache arm only."""
    out = subprocess.run(metrale_cmd("bench", "--workload", "chat", "--model", str(EMBEDDED), "--conversations", "2",
                                     "--turns", "2", "--system-tokens", "64", "--user-tokens", "8", "--max-tokens", "4",
                                     "--enforce-eager", "--out-dir", str(tmp_path)),
                         env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "chat.json").read_text())
    assert (tmp_path / "chat.png").stat().st_size > 0
    assert record["host"]["cpu_count"] >= 1 and record["packages"]["metrale_venv"]["torch"]
    arms = record["arms"]
    assert [t["cached_tokens"] for t in arms["no-cache"]["turns"]] == [0, 0]
    assert arms["cache"]["turns"][1]["cached_tokens"] >= 2 * 48   # the system prompt's full blocks, at least
    assert arms["cache"]["server_prefix_hit_rate"] > 0 and arms["no-cache"]["server_prefix_hit_rate"] is None
    assert arms["cache"]["output_tokens"] == arms["no-cache"]["output_tokens"] == 2 * 2 * 4
    assert set(record["ratios"]) == {"ttft_later_turns_p50_vs_no_cache", "tok_s_vs_no_cache"}
    too_long = subprocess.run(metrale_cmd("bench", "--workload", "chat", "--model", str(EMBEDDED), "--turns", "40"),
                              env=run_env(), capture_output=True, text=True, timeout=120)
    assert too_long.returncode == 2 and "past the model's context of 2048" in too_long.stderr


def test_vllm_arms_are_refused_in_one_line_without_the_peer_python(monkeypatch):
    from bench.benchmark import BenchConfig
    monkeypatch.delenv("METRALE_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="--vllm-python PATH or METRALE_VLLM_PYTHON"):
        BenchConfig(model=str(EMBEDDED), arms=("none", "vllm"))
    with pytest.raises(ValueError, match="not an executable"):
        BenchConfig(model=str(EMBEDDED), arms=("vllm-mtp1",), vllm_python="/nonexistent/python")
    with pytest.raises(ValueError, match=r"unknown bench arm 'vllm-mtp9'"):
        BenchConfig(model=str(EMBEDDED), arms=("vllm-mtp9",), vllm_python="/bin/sh")
    with pytest.raises(ValueError, match="run at --ep 1 with plain requests only"):
        BenchConfig(model=str(EMBEDDED), arms=("vllm",), vllm_python="/bin/sh", request_kinds=("json",))


def test_a_vllm_child_that_dies_is_reported_not_waited_on(tmp_path):
    from bench.vllm_arm import VLLMArm
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no vllm here' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="the vLLM child exited with code 3"):
        VLLMArm("vllm", str(EMBEDDED), "float32", str(fake), max_num_seqs=4, threads=2)
