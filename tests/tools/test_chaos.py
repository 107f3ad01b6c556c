"""tools/chaos.py: a short chaos run against `metrale serve --ep 2` (mp), and its pure parts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_env
from tools.chaos import Result, compare, longest_stall, make_requests, parse_faults

ROOT = Path(__file__).resolve().parents[2]


def test_fault_schedules_parse_and_bad_ones_are_named():
    assert parse_faults("stop@8, kill@2,burst@0") == [(0.0, "burst"), (2.0, "kill"), (8.0, "stop")]
    assert parse_faults("") == []
    for bad, match in (("kill", "expected KIND@SECONDS"), ("nuke@3", "kind must be one of"),
                       ("kill@-1", "seconds >= 0"), ("kill@soon", "expected KIND@SECONDS")):
        with pytest.raises(ValueError, match=match):
            parse_faults(bad)


def test_requests_mix_greedy_seeded_lengths_and_cancellations():
    reqs = make_requests(["abcdefghij" * 40], 12, cancel_every=4, max_tokens=16)
    assert [r.seed is None for r in reqs[:4]] == [True, False, True, False]
    assert len({r.max_tokens for r in reqs}) > 3 and len({len(r.prompt) for r in reqs}) > 3
    assert [r.index for r in reqs if r.cancel_after is not None] == [3, 7, 11]


def test_compare_counts_wrong_lost_errored_and_cancelled():
    ref = [Result(i, text=f"t{i}", tokens=3, finish="length") for i in range(5)]
    got = [Result(0, text="t0", tokens=3, finish="length"), Result(1, text="tX", tokens=3, finish="length"),
           Result(2, error="APIConnectionError"), Result(3, text="t3", tokens=1),          # no finish: lost
           Result(4, text="t", tokens=1, cancelled=True)]
    out = compare(ref, got)
    assert (out["completed"], out["wrong"], out["wrong_requests"], out["errored"], out["lost"], out["cancelled"]) == \
        (2, 1, [1], 1, 1, 1)
    assert out["error_kinds"] == {"APIConnectionError": 1} and out["compared"] == 2


def test_the_longest_stall_spans_a_fault_up_to_the_first_token_after_healing():
    results = [Result(0, chunk_times=[0.5, 1.0, 1.2, 4.0, 4.1]), Result(1, chunk_times=[0.9, 2.0, 5.0])]
    assert longest_stall(results, 1.1, 3.0) == 2.0      # 2.0 -> 4.0
    assert longest_stall(results, 1.1, 1.15) == 0.1     # 1.1 -> 1.2, the first token after healing
    assert longest_stall(results, 1.1, 6.0) is None     # no token after healing


@pytest.mark.timeout(150)
def test_a_short_chaos_run_loses_nothing(tmp_path):
    out = tmp_path / "chaos"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "chaos.py"), "--clients", "4", "--requests", "3",
                           "--max-tokens", "24", "--cancel-every", "4", "--faults", "kill@1,burst@2", "--burst", "3",
                           "--ep-timeout", "10", "--out", str(out)],
                          cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:] + \
        (out / "server.log").read_text()[-3000:]
    record = json.loads((out / "chaos.json").read_text())
    f = record["faulted"]
    assert record["ok"] and f["lost"] == 0 and f["wrong"] == 0 and f["errored"] == 0
    assert f["cancelled"] == 3 and f["compared"] == f["completed"] == 9
    kill, burst = record["faults"]
    assert kill["kind"] == "kill" and kill["restarts"] == 1 and kill["stale_rank_gone"]
    assert burst["kind"] == "burst" and burst["disconnected"] == 3
    assert record["cache_after"]["ok"] and record["cache_after"]["free_blocks"] == record["cache_after"]["total_blocks"]
    assert (out / "chaos.png").stat().st_size > 10_000
