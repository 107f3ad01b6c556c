"""Speculation settings travel as one resolved object: engines with different ladders, width caps
and confidence stops live side by side in one process, each doing what its own settings say."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.model.config import ConfigError
from runtime.sample.sampler import SamplingParams
from serving.llm import LLM
from speculative.depth import DepthPolicy, DraftPlan
from speculative.settings import SpecSettings, resolve_spec_settings
from speculative.tree_shape import TreeShape

PROMPTS = [[5, 17, 200, 3], [9, 9, 9, 100], [300, 4, 4]]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def drafted_per_verify(llm: LLM, prompts) -> float:
    llm.engine.metrics = type(llm.engine.metrics)()
    llm.generate(prompts, PARAMS)
    m = llm.engine.metrics
    return m.drafted_tokens / m.verifies if m.verifies else 0.0


def test_engines_with_different_settings_in_one_process(ckpt_mtp):
    def mtp(**kw) -> LLM:
        return LLM(ckpt_mtp, dtype="float64", kv_cache_tokens=2048,
                   spec_settings=SpecSettings(method="mtp", num_drafts=3, **kw))

    one = mtp(ladder=((8, 1),))
    three = mtp(ladder=((8, 3),))
    capped = mtp(ladder=((8, 3),), width_cap=2)
    stopped = mtp(depth_policy="fixed", confidence_stop=0.999)
    plain = [o.token_ids for o in LLM(ckpt_mtp, dtype="float64").generate(PROMPTS, PARAMS)]
    for _ in range(2):   # interleaved: nothing one engine does leaks into another
        assert drafted_per_verify(one, PROMPTS) == 1.0
        assert drafted_per_verify(three, PROMPTS) > 2.5
        assert drafted_per_verify(capped, PROMPTS) == 0.0         # 3 running > the cap of 2: plain steps
        assert drafted_per_verify(capped, PROMPTS[:2]) > 2.5      # 2 running: speculation
        assert 1.0 <= drafted_per_verify(stopped, PROMPTS) < 2.0   # the stop cuts almost every chain early
    for llm in (one, three, capped, stopped):
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain


def test_resolution_order_argument_then_environment_then_folder(ckpt_mtp, tmp_path, monkeypatch):
    import shutil

    import speculative.settings as settings
    model = tmp_path / "m"
    shutil.copytree(ckpt_mtp, model)
    (model / "metrale.toml").write_text("[behavior]\nmtp_max_seqs = 6\n")
    s = resolve_spec_settings(method="mtp", model_dir=model)
    assert (s.width_cap, s.width_cap_source.value, s.depth_policy) == (6, "model_default", "ladder")
    assert resolve_spec_settings(method="mtp", width_cap=3, model_dir=model).width_cap == 3
    assert resolve_spec_settings(method="mtp", k_ladder="auto").depth_policy == "auto"
    assert resolve_spec_settings(method="mtp", k_ladder="2:1, 9:2").ladder == ((2, 1), (9, 2))
    assert resolve_spec_settings(method="none", num_drafts=3).num_drafts == 0
    monkeypatch.setattr(settings, "tree_shape_env", lambda: "1,2")
    assert resolve_spec_settings(method="mtp").tree_shape == TreeShape.parse("1,2")        # the environment
    assert resolve_spec_settings(method="mtp", tree_shape="2").tree_shape == TreeShape.parse("2")  # the argument
    assert resolve_spec_settings(method="ngram").tree_shape is None                        # MTP only
    for bad, needle in (({"k_ladder": "4:x"}, "is not a ladder"), ({"width_cap": 0}, "outside 1..=128"),
                        ({"confidence_stop": 1.0}, "strictly between 0 and 1"),
                        ({"tree_shape": "1,2", "verify": "rejection"}, "keyed target draws only")):
        with pytest.raises(ValueError, match=needle):
            resolve_spec_settings(method="mtp", **bad)


def test_depth_policy_gives_depth_and_rows_per_sequence():
    chain = DepthPolicy(SpecSettings(method="mtp", num_drafts=3, ladder=((2, 3), (8, 1)), width_cap=8))
    assert chain.plans(2, [10, 3, 1]) == [DraftPlan(3, 3), DraftPlan(2, 2), DraftPlan(0, 0)]   # room caps depth
    assert chain.plans(5, [10]) == [DraftPlan(1, 1)]
    assert chain.plans(9, [10]) == [DraftPlan(0, 0)]                                          # above the cap
    tree = DepthPolicy(SpecSettings(method="mtp", num_drafts=3, tree_shape=TreeShape.parse("1,2,2")))
    assert tree.plans(1, [10, 3]) == [DraftPlan(3, 5), DraftPlan(2, 3)]                     # rows: the nodes
    stop = DepthPolicy(SpecSettings(method="mtp", num_drafts=3, confidence_stop=0.5))
    assert stop.verify_depth(3, [0.9, 0.4, 0.9]) == 2 and stop.verify_depth(3, [0.9, 0.6]) == 2
    assert stop.verify_depth(1, [0.9, 0.9, 0.9]) == 1


def test_a_dtype_table_of_the_folder_beats_its_shared_values(ckpt_mtp, tmp_path):
    import shutil
    model = tmp_path / "m"
    shutil.copytree(ckpt_mtp, model)
    (model / "metrale.toml").write_text('[behavior]\nmtp_max_seqs = 8\nmtp_k_ladder = "4:3,8:1"\n'
                                        '[behavior.bfloat16]\nmtp_max_seqs = 2\nmtp_k_ladder = "2:3"\n')
    bf16 = resolve_spec_settings(method="mtp", model_dir=model, dtype="bfloat16")
    assert (bf16.width_cap, bf16.ladder, bf16.width_cap_source.value) == (2, ((2, 3),), "model_default")
    assert resolve_spec_settings(method="mtp", model_dir=model, dtype=torch.bfloat16).width_cap == 2
    for dtype in ("float32", "float64", None):       # no table of their own: the shared values
        s = resolve_spec_settings(method="mtp", model_dir=model, dtype=dtype)
        assert (s.width_cap, s.ladder) == (8, ((4, 3), (8, 1)))
    assert resolve_spec_settings(method="mtp", model_dir=model, dtype="bfloat16", width_cap=5).width_cap == 5
    (model / "metrale.toml").write_text('[behavior]\nmtp_max_seqs = 8\n[behavior.bfloat16]\nmtp_k_ladder = "2:x"\n')
    assert resolve_spec_settings(method="mtp", model_dir=model, dtype="float32").width_cap == 8
    with pytest.raises(ConfigError, match="is not a ladder"):
        resolve_spec_settings(method="mtp", model_dir=model, dtype="bfloat16")
    for bad, needle in (("[behavior.fp8]\nmtp_max_seqs = 2\n", "not a dtype table"),
                        ("[behavior.bfloat16.extra]\nmtp_max_seqs = 2\n", "holds values, not tables")):
        (model / "metrale.toml").write_text(bad)
        with pytest.raises(ConfigError, match=needle):
            resolve_spec_settings(method="mtp", model_dir=model, dtype="float32")


def test_the_embedded_model_speculates_at_one_sequence_only_in_bfloat16():
    model = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
    bf16 = resolve_spec_settings(method="mtp", model_dir=model, dtype="bfloat16")
    f32 = resolve_spec_settings(method="mtp", model_dir=model, dtype="float32")
    assert (bf16.width_cap, bf16.ladder) == (1, ((1, 3),))
    assert (f32.width_cap, f32.ladder) == (8, ((4, 3), (8, 1)))
