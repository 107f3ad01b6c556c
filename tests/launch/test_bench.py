"""`metrale bench`: arms side by side, repeated runs taking turns, a JSON record and a PNG plot."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.benchmark import median_cell
from tests.conftest import metrale_cmd, run_env

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"


def test_median_cell_keeps_the_middle_run_and_lists_all():
    runs = [{"tok_s": 30.0, "x": "a"}, {"tok_s": 10.0, "x": "b"}, {"tok_s": 20.0, "x": "c"}]
    cell = median_cell(runs)
    assert cell["x"] == "c" and cell["tok_s_runs"] == [30.0, 10.0, 20.0]
    assert median_cell(runs[:2])["x"] == "b"  # even count: the lower middle


def test_bench_writes_record_and_plot(tmp_path):
    out = subprocess.run(metrale_cmd("bench", "--model", str(EMBEDDED), "--arms", "none,k2,ladder",
                                     "--concurrency", "1,2", "--max-tokens", "6", "--requests", "2", "--repeats", "2",
                                     "--json-out", str(tmp_path / "b.json"), "--plot-out", str(tmp_path / "b.png")),
                         env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((tmp_path / "b.json").read_text())
    cells = {(c["arm"], c["concurrency"]): c for c in record["cells"]}
    assert set(cells) == {(a, c) for a in ("none", "k2", "ladder") for c in (1, 2)}
    for (arm, c), cell in cells.items():
        assert len(cell["tok_s_runs"]) == 2 and cell["tok_s"] in cell["tok_s_runs"]
        assert cell["output_tokens"] == 2 * 6
        if arm == "none":
            assert cell["tok_s_ratio_vs_none"] == 1.0 and "tok_s_ratio_vs_best_fixed" not in cell
        else:
            assert cell["accept_len"] >= 1.0
    best = max(cells[("none", 1)]["tok_s"], cells[("k2", 1)]["tok_s"])
    assert abs(cells[("ladder", 1)]["tok_s_ratio_vs_best_fixed"] - cells[("ladder", 1)]["tok_s"] / best) < 1e-3
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


def test_bench_at_ep2_runs_each_arm_with_its_own_group(tmp_path):
    out = subprocess.run(metrale_cmd("bench", "--model", str(EMBEDDED), "--arms", "none,k1", "--ep", "2",
                                     "--concurrency", "1", "--max-tokens", "4", "--requests", "2",
                                     "--json-out", str(tmp_path / "b.json")),
                         env=run_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cells = json.loads((tmp_path / "b.json").read_text())["cells"]
    assert [(c["arm"], c["ep"], c["output_tokens"]) for c in cells] == [("none", 2, 8), ("k1", 2, 8)]
