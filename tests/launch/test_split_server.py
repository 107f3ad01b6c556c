"""bench/serve/split_server.py, the process-split prototype the serving design was measured against: it
serves the tokens `LLM.generate` gives, streamed and not, and the engine process ends with it."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from runtime.sample.sampler import SamplingParams
from serving.llm import LLM
from tests.conftest import ROOT, run_env
from tests.launch.test_server import free_port, http

PROMPT = [5, 17, 42, 99, 7]


def test_split_server_gives_generates_tokens(ckpt_plain):
    llm = LLM(ckpt_plain, dtype="float64", enforce_eager=True)
    want = llm.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))[0].text
    llm.shutdown()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.serve.split_server", "--model", str(ckpt_plain), "--dtype", "float64",
                             "--port", str(port), "--enforce-eager"], cwd=ROOT, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if http("GET", base + "/v1/models", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        body = {"model": "served", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        status, raw = http("POST", base + "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"}, timeout=60)
        assert status == 200, raw
        plain = json.loads(raw)["choices"][0]
        assert plain["finish_reason"] == "length"
        status, raw = http("POST", base + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                           {"Content-Type": "application/json"}, timeout=60)
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(e["choices"][0]["text"] for e in events) == plain["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert want and plain["text"] == want
