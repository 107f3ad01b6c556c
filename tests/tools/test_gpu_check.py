"""`make gpu-check`'s script in its CPU smoke mode: every stage runs (the cuda tests skip), the
table prints the arms of both models with their roofline columns, and the JSON record holds them."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, run_env


def test_gpu_check_smoke_on_the_cpu(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--device", "cpu", "--smoke", "--out-dir", str(out),
                           "--budget-s", "400"], cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["device"] == "cpu" and record["smoke"]
    assert record["tests"].get("skipped", 0) > 0 and not record["tests"].get("failed")
    arms = {(r["model"], r["arm"]) for r in record["rows"]}
    assert {("embedded", "none-eager"), ("embedded", "k1-eager"), ("embedded", "hf")} <= arms
    assert any(m.startswith("random-") and a == "none-eager" for m, a in arms)
    for r in record["rows"]:
        assert r["tok_s"] > 0 and r["roof_ms"] > 0
        if r["arm"] != "hf":
            assert r["device"] == "cpu" and r["step_ms"] > 0
    assert record["ratios"]["embedded"]["best_k_over_none"] is not None
    assert "step_over_roof" in proc.stdout and "cuda tests: 0 passed, 0 failed" in proc.stdout
