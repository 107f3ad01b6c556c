"""The K-versus-width ladder, the width cap and the confidence stop, with exact values (docs/design.md §5.3, §5.4)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from speculative import ladder as L
from speculative.draft_stop import chain_depth
from tests.conftest import run_env

DEFAULT = [(4, 3), (8, 3), (16, 1), (32, 1)]


def test_parse():
    assert L.parse_mtp_k_ladder("4:3,8:3,16:1,32:1") == DEFAULT
    assert L.parse_mtp_k_ladder(" 16 : 1 ,4:3 , 32:1,8 :3 ") == DEFAULT   # spaces, any order
    for bad in ("", "   ", "4:3,", "4:3,x:1", "4-3", "0:2", "4:-1", "4:3:1", "4:3;8:2"):
        assert L.parse_mtp_k_ladder(bad) is None, bad


@pytest.mark.parametrize("n_active, num_drafts, want", [
    (1, 3, 3), (4, 3, 3), (5, 3, 3), (8, 3, 3), (9, 3, 1), (16, 3, 1), (17, 3, 1), (32, 3, 1), (100, 3, 1),
    (1, 2, 2), (1, 0, 0), (20, 0, 0), (1, 5, 3)])
def test_lookup_and_clamp(n_active, num_drafts, want):
    assert L.ladder_drafts_from_steps(DEFAULT, n_active, num_drafts) == want


def test_zero_drafts_step_clamps_to_one():
    assert L.ladder_drafts_from_steps([(4, 0)], 2, 3) == 1


@pytest.mark.parametrize("cli, model, disabled, want", [
    (None, None, False, (32, L.MtpMaxSeqsSource.ENGINE_DEFAULT)),
    (None, None, True, (4, L.MtpMaxSeqsSource.ENGINE_DEFAULT)),
    (None, 0, False, (32, L.MtpMaxSeqsSource.ENGINE_DEFAULT)),
    (None, 12, True, (12, L.MtpMaxSeqsSource.MODEL_DEFAULT)),
    (7, 12, False, (7, L.MtpMaxSeqsSource.CLI)),
    (128, None, False, (128, L.MtpMaxSeqsSource.CLI))])
def test_resolve_width_cap(cli, model, disabled, want):
    assert L.resolve_mtp_max_seqs(cli, model, disabled) == want


@pytest.mark.parametrize("cli, model", [(0, None), (129, None), (None, 200)])
def test_width_cap_refused_outside_range(cli, model):
    with pytest.raises(ValueError, match="outside 1..=128"):
        L.resolve_mtp_max_seqs(cli, model, False)


def test_chain_depth():
    ln = math.log(0.5)
    assert chain_depth([], ln) == 0
    assert chain_depth([-0.1, -0.2, -0.3], ln) == 3
    assert chain_depth([-0.1, -2.0, -0.1], ln) == 2     # the low-confidence draft itself is kept
    assert chain_depth([-3.0], ln) == 1
    assert chain_depth([ln, ln], ln) == 2               # exactly ln_tau continues
    assert chain_depth([float("nan"), -0.1], ln) == 2   # NaN never stops


def run(code: str, env: dict[str, str]) -> str:
    base = {k: v for k, v in run_env().items() if not k.startswith("METRALE_")}
    out = subprocess.run([sys.executable, "-c", "from speculative import ladder as L\n" + code],
                         env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_environment_is_read_once_per_process():
    q = "print(L.mtp_ladder_drafts(2, 3), L.mtp_ladder_drafts(9, 3), L.mtp_ladder_pinned(), L.mtp_max_seqs())"
    assert run(q, {}) == "3 1 False 32"
    assert run(q, {"METRALE_MTP_K_LADDER": "2:1,64:2"}) == "1 2 True 32"
    assert run(q, {"METRALE_MTP_K_LADDER": "2:1,oops"}) == "3 1 True 32"     # bad value: default, still pinned
    assert run(q, {"METRALE_MTP_K_LADDER": ""}) == "3 1 True 32"
    assert run(q, {"METRALE_NO_MTP_K_LADDER": "0"}) == "3 3 False 4"          # present with any value: off
    cli = "L.set_mtp_k_ladder('4:2,100:1'); " + q
    assert run(cli, {"METRALE_MTP_K_LADDER": "2:1"}) == "2 1 True 32"         # the CLI beats the variable


def test_publish_once():
    code = ("L.set_mtp_max_seqs(8); L.set_mtp_max_seqs(8); print(L.mtp_max_seqs())\n"
            "try:\n    L.set_mtp_max_seqs(9)\nexcept ValueError as e:\n    print('refused', e)\n"
            "try:\n    L.set_mtp_k_ladder('bad')\nexcept ValueError as e:\n    print('refused ladder')\n")
    out = run(code, {}).splitlines()
    assert out[0] == "8" and out[1].startswith("refused mtp_max_seqs was already published as 8")
    assert out[2] == "refused ladder"


def test_above_the_width_cap_no_drafter_forward_runs(ckpt_mtp):
    from serving.llm import LLM
    from runtime.sample.sampler import SamplingParams
    from speculative.mtp import MTPProposer
    calls = []
    llm = LLM(ckpt_mtp, dtype="float64", spec="mtp", num_drafts=3, mtp_max_seqs=2, draft_policy="fixed")
    real = MTPProposer._forward

    def counting(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)

    MTPProposer._forward = counting
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
        plain = [o.token_ids for o in LLM(ckpt_mtp, dtype="float64").generate(prompts, params)]
        outs = llm.generate(prompts, params)                # 3 running > cap 2: plain decode steps
        assert calls == [] and llm.engine.metrics.verifies == 0
        assert [o.token_ids for o in outs] == plain
        llm.generate(prompts[:2], params)                   # 2 running: speculation
        assert calls and llm.engine.metrics.verifies > 0
    finally:
        MTPProposer._forward = real


def test_cli_flags_are_checked_at_start(ckpt_plain, tmp_path):
    from tests.conftest import metrale_cmd
    base = ["generate", "--model", str(ckpt_plain), "--prompt", "x", "--max-tokens", "2"]
    for extra, needle in ((["--mtp-k-ladder", "4:x"], "is not a ladder"), (["--mtp-max-seqs", "0"], "outside 1..=128"),
                          (["--draft-confidence-stop", "1.0"], "strictly between 0 and 1")):
        res = subprocess.run(metrale_cmd(*base, *extra), capture_output=True, text=True, env=run_env(), timeout=120)
        assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_llm_takes_the_model_folders_width_cap(ckpt_mtp, tmp_path):
    import shutil
    model = tmp_path / "m"
    shutil.copytree(ckpt_mtp, model)
    (model / "metrale.toml").write_text("[behavior]\nmtp_max_seqs = 6\n")
    from serving.llm import LLM
    from speculative.ladder import MtpMaxSeqsSource
    llm = LLM(model, spec="mtp", kv_cache_tokens=256)
    assert (llm.spec.width_cap, llm.spec.width_cap_source) == (6, MtpMaxSeqsSource.MODEL_DEFAULT)
    assert LLM(model, spec="mtp", kv_cache_tokens=256, mtp_max_seqs=3).spec.width_cap == 3   # the argument wins
    # A published cap (the CLI's) wins over the folder; publishing needs a fresh interpreter.
    code = ("from speculative.settings import resolve_spec_settings\n"
            "L.set_mtp_max_seqs(9)\n"
            f"print(resolve_spec_settings(method='mtp', model_dir={str(model)!r}).width_cap)\n")
    assert run(code, {}) == "9"


def test_the_model_folders_ladder_sits_below_the_argument_the_cli_and_the_environment(ckpt_mtp, tmp_path):
    import shutil

    from runtime.model.config import ConfigError
    from speculative.settings import resolve_spec_settings
    model = tmp_path / "m"
    shutil.copytree(ckpt_mtp, model)
    (model / "metrale.toml").write_text('[behavior]\nmtp_k_ladder = "1:3, 4:1"\n')
    s = resolve_spec_settings(method="mtp", model_dir=model)
    assert (s.ladder, s.depth_policy) == (((1, 3), (4, 1)), "ladder")
    assert [s.ladder_drafts(n) for n in (1, 2, 4, 9)] == [3, 1, 1, 1]
    # A folder's ladder is a default, not a pin: auto still runs, and starts from it.
    auto = resolve_spec_settings(method="mtp", k_ladder="auto", model_dir=model)
    assert (auto.depth_policy, auto.ladder) == ("auto", ((1, 3), (4, 1)))
    assert resolve_spec_settings(method="mtp", k_ladder="2:2", model_dir=model).ladder == ((2, 2),)   # the argument
    assert resolve_spec_settings(method="mtp").ladder == tuple(DEFAULT)                               # no folder
    # The environment and a published (the CLI's) ladder both beat the folder: fresh interpreters.
    code = ("from speculative.settings import resolve_spec_settings\n"
            f"print(resolve_spec_settings(method='mtp', model_dir={str(model)!r}).ladder)\n")
    assert run(code, {}) == "((1, 3), (4, 1))"
    assert run(code, {"METRALE_MTP_K_LADDER": "8:2"}) == "((8, 2),)"
    assert run("L.set_mtp_k_ladder('6:1')\n" + code, {}) == "((6, 1),)"
    for bad in ('"4-3"', "3", '""'):
        (model / "metrale.toml").write_text(f"[behavior]\nmtp_k_ladder = {bad}\n")
        with pytest.raises(ConfigError, match="mtp_k_ladder=.* is not a ladder"):
            resolve_spec_settings(method="mtp", model_dir=model)
