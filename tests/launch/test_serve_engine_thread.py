"""The server steps on the thread that built the engine (one OpenMP thread team), gives the tokens
`LLM.generate` gives, and `metrale bench --workload serve` measures it."""
from __future__ import annotations

import json
import os
import threading

import pytest

from serving.async_engine import AsyncEngine
from serving.deployment import WrongThread
from serving.llm import LLM
from serving.responses import TokenText
from runtime.sample.sampler import SamplingParams
from tests.conftest import ROOT
from tests.launch.test_server import API_KEY, MODEL, http, start_server, stop_server

# The embedded model: big enough for its steps to open OpenMP parallel regions (the tiny test
# checkpoints' steps never do, so a second team could not show).
EMBEDDED = ROOT / "models" / "tiny-glm-moe"

PROMPT = [5, 17, 42, 99, 7, 250, 31, 12]


def num_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.fixture(scope="module")
def served():
    """A float32 eager server on the embedded model (torch on 2 threads: OMP_NUM_THREADS=2 from
    run_env) and its thread count right after it answered /health, before any step."""
    proc, base = start_server(EMBEDDED, "--kv-cache-tokens", "4096", "--max-num-seqs", "8", "--dtype", "float32",
                              "--enforce-eager")
    threads_at_start = num_threads(proc.pid)
    yield proc, base, threads_at_start
    stop_server(proc)


@pytest.fixture(scope="module")
def offline():
    llm = LLM(EMBEDDED, dtype="float32", kv_cache_tokens=4096, max_num_seqs=8, enforce_eager=True)   # as served
    yield llm
    llm.shutdown()


def complete(base: str, **body) -> dict:
    status, raw = http("POST", base + "/v1/completions",
                       json.dumps({"model": MODEL, "prompt": PROMPT, "ignore_eos": True, **body}).encode(),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert status == 200, raw
    return json.loads(raw)


def test_engine_loop_refuses_a_thread_that_did_not_build_the_model(ckpt_plain):
    llm = LLM(ckpt_plain, dtype="float64")
    aengine = AsyncEngine(llm.engine, llm.deployment)
    caught: list[BaseException] = []

    def loop() -> None:
        try:
            aengine.run()
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=loop, name="not-the-builder")
    t.start()
    t.join(timeout=30)
    assert len(caught) == 1 and isinstance(caught[0], WrongThread), caught
    assert "not-the-builder" in str(caught[0])
    llm.shutdown()


def test_serving_opens_no_second_openmp_team(served):
    """The cause of the 0.21x server (issue 44): a step on a thread other than the one that loaded
    and warmed up the model starts a second OpenMP thread team (one more OS thread per extra
    intra-op thread), and libgomp, managing more threads than CPUs, stops spinning. Serving
    requests, streamed and not, must start no thread at all (the old server went from 4 to 5)."""
    proc, base, at_start = served
    complete(base, max_tokens=6)
    status, raw = http("POST", base + "/v1/completions",
                       json.dumps({"model": MODEL, "prompt": "def f(", "max_tokens": 6, "stream": True}).encode(),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert status == 200 and b"[DONE]" in raw
    assert num_threads(proc.pid) == at_start


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0, top_k=20, seed=1234)],
                         ids=["greedy", "seeded"])
def test_lone_request_gives_generates_tokens(served, offline, params):
    _, base, _ = served
    max_tokens = 40
    out = complete(base, max_tokens=max_tokens, logprobs=0, **params)
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))[0]
    assert out["usage"]["completion_tokens"] == max_tokens
    text_of = TokenText(offline.tokenizer)
    assert out["choices"][0]["logprobs"]["tokens"] == [text_of(t) for t in expected.token_ids]
    assert out["choices"][0]["text"] == expected.text


def test_serve_workload_against_our_server(served, tmp_path):
    from launch.cli import main
    _, base, _ = served
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    code = main(["bench", "--workload", "serve", "--model", str(EMBEDDED), "--url", f"ours={base}",
                 "--api-key", API_KEY, "--concurrency", "1,3", "--requests", "4", "--input-len", "6",
                 "--max-tokens", "5", "--json-out", str(out), "--plot-out", str(png)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["models"] == {"ours": MODEL}
    cells = {c["concurrency"]: c for c in record["cells"]}
    assert set(cells) == {1, 3}
    for c in cells.values():
        assert c["requests"] == 4 and c["output_tokens"] == 20 and c["short_requests"] == 0
        assert c["tok_s"] > 0 and 0 < c["ttft_p50_ms"] <= c["ttft_p99_ms"] and c["tpot_p50_ms"] > 0
    assert png.stat().st_size > 0


def test_serve_workload_bad_input():
    from bench.serve.workload import ServeWorkloadConfig, parse_servers
    assert parse_servers(["a=http://h:1/", "http://h:2"]) == (("a", "http://h:1"), ("h:2", "http://h:2"))
    with pytest.raises(ValueError, match="at least one server"):
        ServeWorkloadConfig(servers=(), vocab_size=10)
    with pytest.raises(ValueError, match="not an http"):
        ServeWorkloadConfig(servers=(("a", "ftp://x"),), vocab_size=10)
    with pytest.raises(ValueError, match="repeat"):
        ServeWorkloadConfig(servers=(("a", "http://x"), ("a", "http://y")), vocab_size=10)
    with pytest.raises(ValueError, match="output_len"):
        ServeWorkloadConfig(servers=(("a", "http://x"),), vocab_size=10, output_len=1)


def test_vllm_result_becomes_a_cell(tmp_path):
    from bench.serve.workload import cell_from_vllm_result
    result = {"max_concurrency": 16, "completed": 96, "total_output_tokens": 6144, "duration": 3.2,
              "output_throughput": 1920.0, "request_throughput": 30.0, "mean_ttft_ms": 20.0, "median_ttft_ms": 18.0,
              "p99_ttft_ms": 40.0, "mean_tpot_ms": 7.0, "median_tpot_ms": 6.6, "p99_tpot_ms": 9.0}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    cell = cell_from_vllm_result(path, "vllm")
    assert (cell["concurrency"], cell["tok_s"], cell["ttft_p50_ms"], cell["tpot_p50_ms"], cell["tpot_p90_ms"]) == \
        (16, 1920.0, 18.0, 6.6, None)
    path.write_text(json.dumps({"completed": 1}))
    with pytest.raises(ValueError, match="not a `vllm bench serve` result"):
        cell_from_vllm_result(path, "vllm")
