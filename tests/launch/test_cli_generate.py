"""`metrale generate` end to end through a subprocess: output, JSON lines, and bad input."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.conftest import metrale_cmd, run_env, write_jsonl

TIMEOUT = 120


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(metrale_cmd(*args), capture_output=True, text=True, env=run_env(), timeout=TIMEOUT)


def refused_in_process(capsys: pytest.CaptureFixture, *args: str) -> str:
    """The CLI's `main` in this process, for a refusal found before any model loads or setting is
    published (test_bad_inputs_fail_with_one_line runs the real command): its one stderr line."""
    from launch.cli import main
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:   # argparse's own refusals
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (args, code, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_generate_json_lines_in_input_order(ckpt_plain, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "def add(a, b):"}, {"prompt_ids": [5, 6, 7]},
                                                  {"prompt": "import os"}])
    res = run("generate", "--model", str(ckpt_plain), "--prompts-file", str(prompts), "--max-tokens", "5",
              "--ignore-eos", "--json", "--dtype", "float64")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert set(r) == {"index", "token_ids", "text", "finish_reason", "num_verifies", "drafted_tokens",
                          "accepted_tokens"}
        assert len(r["token_ids"]) == 5 and r["finish_reason"] == "length"
        assert r["num_verifies"] == r["drafted_tokens"] == r["accepted_tokens"] == 0
    # The batch gives what a single prompt gives (python -m launch is the same CLI as metrale).
    alone = run("generate", "--model", str(ckpt_plain), "--prompt", "import os", "--max-tokens", "5",
                "--ignore-eos", "--json", "--dtype", "float64", "--no-prefix-cache")
    assert json.loads(alone.stdout)["token_ids"] == rows[2]["token_ids"]


def test_generate_plain_text(ckpt_plain):
    from serving import LLM, SamplingParams
    res = run("generate", "--model", str(ckpt_plain), "--prompt", "x = 1", "--max-tokens", "4", "--enforce-eager")
    assert res.returncode == 0, res.stderr
    # stdout is the continuation itself: what the same model generates in-process, and nothing more.
    want = LLM(ckpt_plain, kv_cache_tokens=256).generate("x = 1", SamplingParams(max_tokens=4))[0]
    assert len(want.token_ids) == 4 and want.text
    assert res.stdout == want.text + "\n"
    # stderr is one summary line whose counts are the prompts and tokens just generated.
    [summary] = res.stderr.strip().splitlines()
    m = re.fullmatch(r"\[1 prompt\(s\), (\d+) tokens in (\d+\.\d\d)s, (\d+\.\d) tok/s generating\]", summary)
    assert m, summary
    assert int(m.group(1)) == len(want.token_ids)
    assert float(m.group(3)) > 0


@pytest.mark.parametrize("extra, needle", [
    (["--max-tokens", "0"], "max_tokens=0"),
    (["--temperature", "-1"], "temperature=-1"),
    (["--top-p", "1.5"], "top_p=1.5"),
    (["--presence-penalty", "3"], "--presence-penalty: presence_penalty=3.0 must be in [-2, 2]"),
    (["--min-tokens", "9", "--max-tokens", "4"], "--min-tokens: min_tokens=9"),
    (["--logit-bias", "5:1"], "--logit-bias '5:1': expected TOKEN_ID=BIAS"),
])
def test_bad_sampling_flags(ckpt_plain, extra, needle, capsys):
    assert needle in refused_in_process(capsys, "generate", "--model", str(ckpt_plain), "--prompt", "hi", *extra)


def test_sampling_flags_reach_the_sampler(ckpt_plain):
    from serving import LLM, SamplingParams
    flags = ["--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty", "1.2",
             "--min-p", "0.05", "--logit-bias", "77=4", "--logit-bias", "0=100", "--min-tokens", "5"]
    res = run("generate", "--model", str(ckpt_plain), "--prompt", "x = 1", "--max-tokens", "12", "--json",
              "--dtype", "float64", "--temperature", "0.7", "--seed", "3", *flags)
    assert res.returncode == 0, res.stderr
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3, frequency_penalty=1.5, presence_penalty=0.5,
                            repetition_penalty=1.2, min_p=0.05, logit_bias={77: 4, 0: 100}, min_tokens=5)
    want = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=256).generate("x = 1", params)[0]
    got = json.loads(res.stdout)
    # EOS (0) pushed to the top is held back for 5 tokens, then ends the request.
    assert got["token_ids"] == want.token_ids and len(want.token_ids) == 6 and got["finish_reason"] == "stop"
    plain = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=256).generate(
        "x = 1", SamplingParams(max_tokens=5, temperature=0.7, seed=3, ignore_eos=True))[0]
    assert want.token_ids[:5] != plain.token_ids                       # the flags changed the tokens


def test_sampling_flags_parse_into_the_params():
    from launch.cli import build_parser, sampling_params
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--frequency-penalty", "1.5",
                                      "--presence-penalty", "-0.5", "--repetition-penalty", "1.2", "--min-p", "0.05",
                                      "--logit-bias", "77=4", "--logit-bias", "0=-100", "--min-tokens", "5"])
    p = sampling_params(args)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == \
        (1.5, -0.5, 1.2, 0.05, 5)
    assert p.logit_bias == ((0, -100.0), (77, 4.0))


def test_bad_inputs_fail_with_one_line(ckpt_plain, tmp_path, capsys):
    # A prompts file is read before anything loads: in this process.
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    for name, needle in (("none.jsonl", "none.jsonl"), ("broken.jsonl", "broken.jsonl:1")):
        assert needle in refused_in_process(capsys, "generate", "--model", str(ckpt_plain),
                                            "--prompts-file", str(tmp_path / name))
    cases = [
        (["--model", str(tmp_path / "missing"), "--prompt", "hi"], "missing"),
        (["--model", str(ckpt_plain), "--prompts-file",
          str(write_jsonl(tmp_path / "oov.jsonl", [{"prompt_ids": [1, 99999]}]))], "99999"),
        (["--model", str(ckpt_plain), "--prompt", "word " * 400], "context"),
    ]
    empty = tmp_path / "empty_model"
    empty.mkdir()
    cases.append((["--model", str(empty), "--prompt", "hi"], "config.json"))
    for args, needle in cases:
        res = run("generate", *args)
        assert res.returncode == 2, (args, res.stderr)
        assert needle in res.stderr, (needle, res.stderr)
        assert "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_tree_shape_flag(ckpt_mtp, tmp_path, capsys):
    args = ("generate", "--model", str(ckpt_mtp), "--prompt", "x = 1", "--max-tokens", "12", "--ignore-eos",
            "--json", "--dtype", "float64")
    plain = run(*args)
    tree = run(*args, "--spec", "mtp", "--tree-shape", "1,2,2")
    assert tree.returncode == 0, tree.stderr
    got = json.loads(tree.stdout)
    assert got["token_ids"] == json.loads(plain.stdout)["token_ids"] and got["num_verifies"] > 0
    for extra, needle in ((["--spec", "mtp", "--tree-shape", "1,2,5"], "count 5 is outside 1..=4"),
                          (["--spec", "mtp", "--tree-shape", "2,2,2,2"], "8 nodes, at most 7"),
                          (["--spec", "mtp", "--tree-shape", "1;2"], "comma list"),
                          (["--tree-shape", "1,2,2"], "needs --spec mtp"),
                          (["--spec", "mtp", "--tree-shape", "1,2", "--spec-verify", "rejection"], "keyed target")):
        assert needle in refused_in_process(capsys, *args, *extra)
    for extra, needle in ((["--arms", "k3,tree"], "needs --tree-shape"),
                          (["--arms", "tree", "--tree-shape", "0,1"], "count 0"),
                          (["--request-kinds", "plain,xml"], "request kind 'xml'")):
        assert needle in refused_in_process(capsys, "bench", "--model", str(ckpt_mtp), *extra)


def test_max_num_batched_tokens_reaches_the_engine(monkeypatch):
    import serving
    from launch.cli import build_parser, make_llm
    got = {}
    monkeypatch.setattr(serving, "LLM", lambda **kw: got.update(kw))
    for argv, want in ((["serve", "--model", "m"], 1024), (["serve", "--model", "m", "--max-num-batched-tokens", "2048"], 2048)):
        make_llm(build_parser().parse_args(argv))
        assert got["max_num_batched_tokens"] == want
