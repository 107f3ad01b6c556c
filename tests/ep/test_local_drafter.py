"""METRALE_NO_MTP_EP_PROPOSE=1 (rank 0 drafts alone with its own experts) and METRALE_MTP_REFEED_SHIFT:
both change drafts only, never the output. Knobs are read once per process: each case is a fresh CLI run."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import metrale_cmd, run_env

PROMPTS = [{"prompt_ids": [5, 17, 200, 3]}, {"prompt_ids": [9, 9, 9, 100, 250, 31]}, {"prompt_ids": [300]}]


def generate(ckpt: Path, prompts: Path, env: dict[str, str], *args: str) -> list[dict]:
    base = {k: v for k, v in run_env().items() if not k.startswith("METRALE_")}
    out = subprocess.run(metrale_cmd("generate", "--model", str(ckpt), "--prompts-file", str(prompts), "--json",
                                     "--dtype", "float64", "--max-tokens", "12", "--ignore-eos",
                                     "--kv-cache-tokens", "1024", *args),
                         env={**base, **env}, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.mark.parametrize("sampling", [(), ("--temperature", "0.8", "--seed", "3")], ids=["greedy", "seeded"])
def test_rank0_drafting_alone_is_lossless(ckpt_mtp, prompts, sampling):
    plain = generate(ckpt_mtp, prompts, {}, *sampling)
    alone = generate(ckpt_mtp, prompts, {"METRALE_NO_MTP_EP_PROPOSE": "1"}, "--ep", "2", "--launcher", "mp",
                     "--spec", "mtp", "--num-drafts", "3", *sampling)
    assert [o["token_ids"] for o in alone] == [o["token_ids"] for o in plain]
    assert sum(o["drafted_tokens"] for o in alone) > 0


def test_refeed_shift_moves_labels_not_output(ckpt_mtp, prompts):
    one = {"METRALE_MTP_CATCHUP": "1", "METRALE_MTP_REFEED_ACCEPTED": "1"}
    base = generate(ckpt_mtp, prompts, one, "--spec", "mtp", "--mtp-max-seqs", "1", "--max-num-seqs", "1")
    shifted = generate(ckpt_mtp, prompts, {**one, "METRALE_MTP_REFEED_SHIFT": "1"}, "--spec", "mtp",
                       "--mtp-max-seqs", "1", "--max-num-seqs", "1")
    assert [o["token_ids"] for o in shifted] == [o["token_ids"] for o in base]
    # The drafter saw other labels, so it drafted differently somewhere.
    assert [(o["drafted_tokens"], o["accepted_tokens"]) for o in shifted] != \
        [(o["drafted_tokens"], o["accepted_tokens"]) for o in base]
