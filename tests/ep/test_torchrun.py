"""The torchrun entry: one node with two processes, and two nodes through torchrun's rendezvous."""
from __future__ import annotations

import json
import subprocess
import sys

from ep.comm import free_port
from tests.conftest import run_env

TIMEOUT = 180


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def generate_args(model) -> list[str]:
    return ["-m", "launch", "generate", "--model", str(model), "--prompt", "def f(x):", "--max-tokens", "6",
            "--ignore-eos", "--json", "--dtype", "float64", "--kv-cache-tokens", "1024"]


def single(model) -> dict:
    out = subprocess.run([sys.executable, *generate_args(model)], capture_output=True, text=True, env=run_env(),
                         timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_torchrun_one_node_two_ranks(ckpt_plain):
    port = free_port()
    res = subprocess.run(torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  *generate_args(ckpt_plain)),
                         capture_output=True, text=True, env=run_env(), timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    assert json.loads(lines[0])["token_ids"] == single(ckpt_plain)["token_ids"]


def test_torchrun_conflicting_ep_is_an_error(ckpt_plain):
    port = free_port()
    res = subprocess.run(torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  *generate_args(ckpt_plain), "--ep", "3"),
                         capture_output=True, text=True, env=run_env(), timeout=TIMEOUT)
    assert res.returncode != 0
    assert "--ep 3 conflicts with torchrun's world size 2" in res.stderr


def test_torchrun_two_nodes_rendezvous(ckpt_plain):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "metrale-test"]
    nodes = [subprocess.Popen(torchrun(*common, "--node-rank", str(i), *generate_args(ckpt_plain)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env())
             for i in range(2)]
    outs = []
    for p in nodes:
        try:
            outs.append(p.communicate(timeout=TIMEOUT))
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in nodes), [e[-1500:] for _, e in outs]
    printed = [line for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert len(printed) == 1
    assert json.loads(printed[0])["token_ids"] == single(ckpt_plain)["token_ids"]
