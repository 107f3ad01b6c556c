"""`make gpu-check`'s script in its CPU smoke mode, run as the GPU machine would run it: from a plain
checkout (the project not installed, nothing on PYTHONPATH but the blocker) with the GPU image's
package set (no Ray, starlette, uvicorn, llguidance, openai or jsonschema; tests/tools/gpu_image).
Every stage runs (the cuda tests skip), each cell reaches cells.jsonl as it finishes, the table
prints the arms of both models with their roofline columns, the JSON record holds them, and the
random checkpoint stays out of the output folder."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from tests.conftest import ROOT

BLOCKER = ROOT / "tests" / "tools" / "gpu_image"


def gpu_image_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(BLOCKER)
    env["TRITON_INTERPRET"] = "1"   # the kernel bench's plumbing on CPU tensors
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def test_the_blocker_hides_the_project_and_the_missing_packages(tmp_path):
    code = ("import importlib\nfor m in ('runtime', 'ray', 'starlette', 'uvicorn', 'llguidance', 'openai', 'jsonschema'):\n"
            "    try:\n        importlib.import_module(m)\n        print('IMPORTED', m)\n"
            "    except ImportError:\n        pass\nimport torch, transformers, safetensors, tokenizers\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=gpu_image_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "IMPORTED" not in proc.stdout, proc.stdout + proc.stderr


def test_gpu_check_smoke_on_the_cpu_with_the_gpu_image_packages(tmp_path):
    out, big = tmp_path / "check", tmp_path / "big" / "random"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--device", "cpu", "--smoke",
                           "--out-dir", str(out), "--big-dir", str(big), "--budget-s", "700"],
                          cwd=tmp_path, env=gpu_image_env(), capture_output=True, text=True, timeout=750)
    stages = (out / "stages.log").read_text()[-6000:] if (out / "stages.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + stages
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["device"] == "cpu" and record["smoke"] and record["torch"] and record["transformers"]
    # Test counts from the junit XML: every cuda test skipped on the CPU, none failed or errored.
    suite = ET.parse(out / "cuda_tests.xml").getroot()
    assert record["tests"]["skipped"] > 0 and record["tests"]["failed"] == 0 and record["tests"]["errors"] == 0
    assert record["tests"]["skipped"] == sum(int(s.get("skipped", 0)) for s in suite.iter("testsuite"))
    arms = {(r["model"], r["arm"]) for r in record["rows"]}
    assert {("embedded", "none-eager"), ("embedded", "k1-eager"), ("embedded", "hf")} <= arms, stages
    assert any(m.startswith("random-") and a == "none-eager" for m, a in arms)
    for r in record["rows"]:
        assert r["tok_s"] > 0 and r["roof_ms"] > 0
        if r["arm"] != "hf":
            assert r["device"] == "cpu" and r["step_ms"] > 0
    assert record["ratios"]["embedded"]["best_k_over_none"] is not None
    # Every cell was written as it finished; the output folder holds a few small files only.
    lines = [json.loads(x) for x in (out / "cells.jsonl").read_text().splitlines()]
    assert lines == record["kernels"] + record["rows"]
    # the kernel bench under the interpreter: each kernel against the path it replaces
    assert {c["kernel"] for c in record["kernels"]} == {"paged_attention", "fused_moe", "sampling", "fp8_linear"}
    assert all(c["same_tokens"] for c in record["kernels"] if c["kernel"] == "sampling")
    assert all(c.get("kernel_us", c.get("fused_us", c.get("fp8_us", 0))) > 0 for c in record["kernels"])
    assert all(c["max_abs_diff"] < 1e-5 for c in record["kernels"] if c["kernel"] == "fp8_linear")
    files = sorted(p.name for p in out.rglob("*"))
    assert files == ["cells.jsonl", "cuda_tests.xml", "gpu_check.json", "stages.log"]
    assert all((out / f).stat().st_size < 1 << 20 for f in files)
    assert (big / "config.json").is_file()
    assert "step_over_roof" in proc.stdout and "cuda tests: 0 passed, 0 failed, 0 errors" in proc.stdout
    assert "stages planned at" in proc.stdout and "at most" in proc.stdout


def test_gpu_check_stage_limits_fit_nine_minutes():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert gpu_check.planned_seconds(smoke=False) < 9 * 60
    # cheapest first: the embedded model's arms before the big checkpoint's
    assert list(gpu_check.FULL) == ["embedded", "big"]
    assert next(iter(gpu_check.FULL["embedded"][0])) == "none-eager"


def test_a_stage_past_its_limit_is_interrupted_and_keeps_its_output(tmp_path):
    """SIGINT first (pytest then still writes its junit XML), and what the stage printed stays."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "tools"))
    code = ("import time\nprint('started', flush=True)\ntry:\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('interrupted: wrote what it had', flush=True)\n")
    out = gpu_check.Out(tmp_path)
    rc, text = gpu_check.run("sleeper", [sys.executable, "-c", code], gpu_check.Budget(60), 5, out)
    assert rc is None and "started" in text and "interrupted: wrote what it had" in text
    assert "timed out after 5 s" in (tmp_path / "stages.log").read_text()
