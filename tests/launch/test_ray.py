"""The Ray launcher: a killed rank recovered while clients stream, multi-node placement, a rank that cannot start.

Each test runs its own Ray (usage statistics off, temp dir under /tmp) and shuts it down.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import metrale_cmd, run_env
from tests.launch.test_server import free_port, http

EMBEDDED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm-moe"
PROMPTS = ["def main(", "import os\n", "class Node:", "for i in range(", "x = [", "return self.", "# parse", "if not"]


@pytest.fixture
def ray_tmp():
    path = tempfile.mkdtemp(prefix="mray", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ray_env() -> dict[str, str]:
    env = run_env()
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("RAY_ADDRESS", None)
    return env


def health(base: str) -> dict:
    status, body = http("GET", base + "/health", timeout=5)
    assert status == 200, body
    return json.loads(body)


def complete(base: str, i: int, stream: bool, progress: dict | None = None) -> str:
    """Completion `i`: even ones greedy, odd ones seeded at temperature 0.8."""
    from openai import OpenAI
    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=240, max_retries=0)
    extra = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 100 + i}
    if not stream:
        r = client.completions.create(model="tiny-glm-moe", prompt=PROMPTS[i], max_tokens=40, **extra,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text
    text = ""
    for chunk in client.completions.create(model="tiny-glm-moe", prompt=PROMPTS[i], max_tokens=40, stream=True,
                                           extra_body={"ignore_eos": True}, **extra):
        if chunk.choices:
            text += chunk.choices[0].text
            progress[i] = progress.get(i, 0) + 1
    return text


def test_killed_rank_recovers_and_streams_complete(ray_tmp, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(metrale_cmd("serve", "--model", str(EMBEDDED), "--port", str(port), "--dtype", "float64",
                                        "--ep", "2", "--launcher", "ray", "--ray-temp-dir", ray_tmp, "--spec", "mtp",
                                        "--ep-timeout", "30", "--kv-cache-tokens", "4096", "--max-num-seqs", "8",
                                        "--mtp-max-seqs", "8"),   # all 8 streams draft (the model's cap, given here too)
                            env=ray_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if http("GET", base + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not come up in 180 s")
        before = health(base)["ranks"]
        assert [r["rank"] for r in before] == [0, 1] and all(r["pid"] > 0 and r["node"] for r in before)
        with cf.ThreadPoolExecutor(8) as pool:  # the undisturbed run, the same server
            reference = list(pool.map(lambda i: complete(base, i, stream=False), range(8)))

        progress: dict[int, int] = {}
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(complete, base, i, True, progress) for i in range(8)]
            deadline = time.time() + 120
            while len(progress) < 8 and time.time() < deadline:  # every stream has begun
                time.sleep(0.05)
            assert len(progress) == 8, progress
            os.kill(before[1]["pid"], signal.SIGKILL)
            killed = time.perf_counter()
            streamed = [f.result(timeout=240) for f in futures]
        assert streamed == reference  # nothing lost, nothing sent twice, the same tokens

        after = health(base)["ranks"]
        assert after[1]["pid"] != before[1]["pid"] and after[0]["pid"] == before[0]["pid"]
        status, body = http("GET", base + "/metrics")
        metrics = body.decode()
        assert re.search(r"^metrale_restarts_total 1\.0$", metrics, re.M), metrics
        recovery = float(re.search(r"^metrale_last_recovery_seconds (\S+)$", metrics, re.M).group(1))
        assert 0 < recovery < time.perf_counter() - killed
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_ranks_placed_one_per_node(ckpt_plain, ray_tmp, monkeypatch):
    """A Ray cluster of two nodes on this machine; STRICT_SPREAD puts rank 1 on the other node."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.setenv("RAY_TMPDIR", ray_tmp)  # where the cluster notes its address: RAY_TMPDIR/ray
    os.makedirs(f"{ray_tmp}/ray")
    import ray
    from ray.cluster_utils import Cluster

    from launch import launcher_for
    from launch.ray_group import RayOptions
    from runtime.sample.sampler import SamplingParams
    from serving.llm import LLM

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": f"{ray_tmp}/ray",
                                                           "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=1)
    llm = None
    try:
        llm = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=1024, ep=2,
                  launcher=launcher_for("ray", ray_options=RayOptions(address=cluster.address,
                                                                      placement_strategy="STRICT_SPREAD")))
        nodes = [r["node"] for r in llm.rank_info]
        assert nodes[0] == cluster.head_node.node_id and nodes[1] == worker_node.node_id
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        two = [o.token_ids for o in llm.generate([[5, 17, 200], [9, 9, 100]], params)]
        llm.shutdown()
        llm = None
        one = LLM(ckpt_plain, dtype="float64", kv_cache_tokens=1024)
        assert [o.token_ids for o in one.generate([[5, 17, 200], [9, 9, 100]], params)] == two
    finally:
        if llm is not None:
            llm.shutdown(graceful=False)
        ray.shutdown()
        cluster.shutdown()


def test_rank_that_cannot_start_gives_a_clear_error(ckpt_plain, ray_tmp, monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from launch import launcher_for
    from launch.ray_group import RayOptions
    from serving.deployment import GroupStartError
    from serving.llm import LLM

    t0 = time.time()
    with pytest.raises(GroupStartError, match=r"rank 1.*no-such-model"):
        LLM(ckpt_plain, dtype="float32", kv_cache_tokens=1024, ep=2, ep_timeout_s=60,
            launcher=launcher_for("ray", ray_options=RayOptions(temp_dir=ray_tmp),
                                  worker_overrides={1: {"model_dir": "/tmp/no-such-model"}}))
    assert time.time() - t0 < 55  # the worker's own error, well before the collective timeout
    assert not ray.is_initialized()  # the Ray it started is shut down
