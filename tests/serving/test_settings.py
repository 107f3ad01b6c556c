"""`LLM.settings`: every setting one LLM runs by, in one resolved object (serving.settings)."""
from __future__ import annotations

from pathlib import Path

from serving.llm import LLM

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"


def test_an_llm_holds_its_resolved_settings_in_one_object():
    llm = LLM(MODEL, dtype="float64", kv_cache_tokens=512, spec="mtp", num_drafts=2, max_num_seqs=8,
              device="cpu")
    s = llm.settings
    assert s.spec is llm.spec and s.spec.num_drafts == 2
    assert s.deployment is llm.deployment.config and s.deployment.kv_cache_tokens == 512
    assert s.engine.max_num_seqs == 8
    # The step as rank 0's runner resolved it: float64 is the reference mode, batch-invariant and eager.
    assert s.step is llm.engine.runner.settings
    assert s.step.batch_invariant and not s.step.compiled and not s.step.static_steps and not s.step.cuda_graphs
    lines = str(s).splitlines()
    assert [line.split(":")[0] for line in lines] == ["deployment", "engine", "spec", "step"]
    assert "kv_cache_tokens=512" in lines[0] and "batch_invariant=True" in lines[3]
