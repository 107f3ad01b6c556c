"""The METRALE_* knobs, read once per process. A knob's parsing is checked in this process with
its cache emptied before and after; reading once, and what other modules build from the knobs,
in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import speculative.knobs as k
from tests.conftest import run_env


def _forget_knobs() -> None:
    for reader in vars(k).values():
        if callable(getattr(reader, "cache_clear", None)):
            reader.cache_clear()


def read_in_process(reader, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """str(reader()) with exactly the METRALE_* variables of `env` set, read afresh."""
    for name in [n for n in os.environ if n.startswith("METRALE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _forget_knobs()
    try:
        return str(reader())
    finally:
        _forget_knobs()


def read_in_subprocess(expr: str, env: dict[str, str]) -> str:
    base = {k: v for k, v in run_env().items() if not k.startswith("METRALE_")}
    code = f"import speculative as s, speculative.knobs as k; print({expr})"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("env, want", [({}, "0"), ({"METRALE_MTP_SHADOW_TOPK": "3"}, "3"),
                                       ({"METRALE_MTP_SHADOW_TOPK": " 5 "}, "5"),
                                       ({"METRALE_MTP_SHADOW_TOPK": "99"}, "8"),
                                       ({"METRALE_MTP_SHADOW_TOPK": "-2"}, "0"),
                                       ({"METRALE_MTP_SHADOW_TOPK": "many"}, "0")])
def test_shadow_topk(env, want, monkeypatch):
    assert read_in_process(k.shadow_topk, env, monkeypatch) == want


@pytest.mark.parametrize("env, want", [({}, "False"), ({"METRALE_MTP_ACCEPT_DEBUG": ""}, "True"),
                                       ({"METRALE_MTP_ACCEPT_DEBUG": "0"}, "True")])
def test_accept_debug_is_on_when_present(env, want, monkeypatch):
    assert read_in_process(k.mtp_accept_debug, env, monkeypatch) == want


def test_refeed_debug_needs_1(monkeypatch):
    assert read_in_process(k.mtp_refeed_debug, {"METRALE_MTP_REFEED_DEBUG": "1"}, monkeypatch) == "True"
    assert read_in_process(k.mtp_refeed_debug, {"METRALE_MTP_REFEED_DEBUG": "yes"}, monkeypatch) == "False"


def test_read_once_per_process():
    code = ("k.shadow_topk(), __import__('os').environ.__setitem__('METRALE_MTP_SHADOW_TOPK', '7'), "
            "k.shadow_topk()")
    assert read_in_subprocess(code, {"METRALE_MTP_SHADOW_TOPK": "2"}) == "2 None 2"


@pytest.mark.parametrize("env, want", [({}, "0"), ({"METRALE_MTP_REFEED_SHIFT": "2"}, "2"),
                                       ({"METRALE_MTP_REFEED_SHIFT": " -1 "}, "-1"),
                                       ({"METRALE_MTP_REFEED_SHIFT": "9"}, "4"),
                                       ({"METRALE_MTP_REFEED_SHIFT": "-9"}, "-4"),
                                       ({"METRALE_MTP_REFEED_SHIFT": "one"}, "0")])
def test_refeed_shift_clamped(env, want, monkeypatch):
    assert read_in_process(k.mtp_refeed_shift, env, monkeypatch) == want


@pytest.mark.parametrize("env, want", [({}, "True"), ({"METRALE_NO_MTP_EP_PROPOSE": "1"}, "False"),
                                       ({"METRALE_NO_MTP_EP_PROPOSE": "0"}, "True")])
def test_ep_propose_on_unless_no_is_1(env, want, monkeypatch):
    assert read_in_process(k.mtp_ep_propose_enabled, env, monkeypatch) == want


CATCHUP = {"METRALE_MTP_CATCHUP": "1", "METRALE_MTP_REFEED_ACCEPTED": "1"}


@pytest.mark.parametrize("env, cap, want", [
    ({}, 1, "False False False"),
    (CATCHUP, 1, "False True True"),                                  # one sequence: the ring is on
    ({"METRALE_MTP_REFEED_ACCEPTED": "1"}, 1, "False False False"),   # refeed needs the ring
    (CATCHUP, 4, "True False False"),                                 # multi-sequence mode: both off
    ({"METRALE_MTP_CATCHUP": "yes"}, 1, "False False False"),
])
def test_catchup_and_refeed_off_in_multi_seq_mode(env, cap, want):
    expr = (f"(__import__('speculative.ladder').ladder.set_mtp_max_seqs({cap}), s.mtp_multi_seq_mode(), "
            "s.mtp_catchup_enabled(), s.mtp_refeed_accepted_enabled())[1:]")
    got = read_in_subprocess(expr, env)
    assert got.strip("()").replace(",", "") == want
