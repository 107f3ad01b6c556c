"""`metrale bench --workload chat`: multi-turn conversations through the OpenAI chat endpoint,
the prefix cache on and off side by side.

Every conversation starts with the same long system prompt and sends its whole history again at
every turn, as chat clients do. Each arm is its own `metrale serve` process (started here, on a
free 127.0.0.1 port, warmed up with a prompt that shares nothing with the workload; start-up is not
measured); all conversations run at once, each turn waiting for the previous reply. Greedy with EOS
ignored, so both arms generate the same number of tokens. Per arm: time to first token per turn
(median, p90), output tokens per second over the arm's wall time, prompt and cached tokens from the
usage, and the server's own prefix-cache counters. The record goes to chat.json and the curves to
chat.png under the output folder.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.corpus import heldout_prompts
from bench.host import host, packages
from bench.report import check_provenance, machine, provenance

ARMS = {"cache": [], "no-cache": ["--no-prefix-cache"]}
TEMPLATE_TOKENS = 24     # room per message for the chat template's own tokens (GLM-4.5 format: 6-19 a tag run)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatBenchConfig:
    model: str
    dtype: str = "float32"
    device: str = "auto"   # every server's --device
    conversations: int = 16
    turns: int = 4
    system_tokens: int = 1000
    user_tokens: int = 48
    max_tokens: int = 64
    spec: str = "none"
    arms: tuple[str, ...] = ("no-cache", "cache")
    enforce_eager: bool = False   # both servers without torch.compile

    def __post_init__(self) -> None:
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms:
            raise ValueError(f"chat bench arms {list(self.arms)}: expected some of {', '.join(ARMS)}")
        for name in ("conversations", "turns", "system_tokens", "user_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        context = json.loads((Path(self.model) / "config.json").read_text())["max_position_embeddings"]
        if self.num_context_tokens() >= context:
            raise ValueError(f"a conversation of {self.turns} turns reaches about {self.num_context_tokens()} tokens, "
                             f"past the model's context of {context}: fewer turns or shorter messages")

    def num_context_tokens(self) -> int:
        """About the longest prompt a conversation sends (its last turn, with the last reply)."""
        return self.system_tokens + self.turns * (self.user_tokens + self.max_tokens + 2 * TEMPLATE_TOKENS)


def workload(config: ChatBenchConfig) -> tuple[str, list[list[str]], str]:
    """(the system prompt, each conversation's user messages, a warm-up prompt sharing nothing
    with them), cut from held-out code to the configured token counts."""
    from engine.tokenizer import Tokenizer
    tok = Tokenizer(Path(config.model))
    texts = heldout_prompts(2 + config.conversations * config.turns)

    def cut(text: str, n: int) -> str:
        ids = tok.encode(text)
        while len(ids) < n:
            ids = ids + tok.encode(text)
        return tok.decode(ids[:n])

    system = cut("".join(texts), config.system_tokens)
    users = [[cut(texts[2 + c * config.turns + t], config.user_tokens) for t in range(config.turns)]
             for c in range(config.conversations)]
    return system, users, cut(texts[1], config.user_tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_turn(base: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: its reply, time to first token and usage."""
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream ended without a usage event")
    return {"text": "".join(text), "ttft_s": (first or time.perf_counter()) - t0,
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


def conversation(base: str, system: str, users: list[str], max_tokens: int, out: list[dict]) -> None:
    messages = [{"role": "system", "content": system}]
    for turn, user in enumerate(users, start=1):
        messages.append({"role": "user", "content": user})
        reply = chat_turn(base, messages, max_tokens)
        messages.append({"role": "assistant", "content": reply.pop("text")})
        out.append({"turn": turn, **reply})


def server_counters(base: str) -> dict:
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        for key in ("hit", "queried"):
            if line.startswith(f"metrale_prefix_cache_{key}_tokens_total "):
                out[key] = float(line.split()[1])
    return out


def start_server(config: ChatBenchConfig, arm: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "launch", "serve", "--model", config.model, "--dtype", config.dtype,
           "--device", config.device, "--port", str(port), "--served-model-name", "bench", "--max-num-seqs", str(config.conversations),
           "--kv-cache-tokens", str(max(65536, 2 * config.conversations * config.num_context_tokens())),
           "--spec", config.spec, *ARMS[arm]] + (["--enforce-eager"] if config.enforce_eager else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {arm} server exited: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return proc, base
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the {arm} server did not answer /health within 300 s")


def run_arm(config: ChatBenchConfig, arm: str, system: str, users: list[list[str]], warmup: str) -> dict:
    proc, base = start_server(config, arm)
    try:
        for n in (4, config.max_tokens):   # compile warm-up, on a prompt that shares nothing with the workload
            chat_turn(base, [{"role": "user", "content": warmup}], n)
        before = server_counters(base)
        turns: list[list[dict]] = [[] for _ in users]
        threads = [threading.Thread(target=conversation, args=(base, system, u, config.max_tokens, out))
                   for u, out in zip(users, turns)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = server_counters(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    done = [r for conv in turns for r in conv]
    if len(done) != config.conversations * config.turns:
        raise RuntimeError(f"arm {arm}: {len(done)} of {config.conversations * config.turns} turns finished")
    tokens = sum(r["completion_tokens"] for r in done)
    per_turn = []
    for turn in range(1, config.turns + 1):
        ttft = sorted(r["ttft_s"] for r in done if r["turn"] == turn)
        per_turn.append({"turn": turn, "ttft_p50_ms": round(1000 * statistics.median(ttft), 2),
                         "ttft_p90_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 2),
                         "prompt_tokens": sum(r["prompt_tokens"] for r in done if r["turn"] == turn),
                         "cached_tokens": sum(r["cached_tokens"] for r in done if r["turn"] == turn)})
    later = [r["ttft_s"] for r in done if r["turn"] > 1]
    hits, queried = after.get("hit", 0) - before.get("hit", 0), after.get("queried", 0) - before.get("queried", 0)
    return {"arm": arm, "wall_s": round(wall, 3), "output_tokens": tokens, "tok_s": round(tokens / wall, 2),
            "ttft_later_turns_p50_ms": round(1000 * statistics.median(later), 2) if later else None,
            "turns": per_turn, "server_prefix_hit_rate": round(hits / queried, 4) if queried else None}


def plot(arms: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, a in arms.items():
        left.plot([t["turn"] for t in a["turns"]], [t["ttft_p50_ms"] for t in a["turns"]], marker="o", label=name)
    left.set(xlabel="turn", ylabel="median time to first token (ms)", title="TTFT per turn")
    left.set_xticks([t["turn"] for t in next(iter(arms.values()))["turns"]])
    left.legend()
    right.bar(list(arms), [a["tok_s"] for a in arms.values()])
    right.set(ylabel="output tokens/s", title="throughput")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_chat_bench(config: ChatBenchConfig, out_dir: Path) -> dict:
    """Run every arm, print a line each, write chat.json and chat.png into `out_dir`."""
    start = provenance()
    system, users, warmup = workload(config)
    print(f"chat bench: {config.conversations} conversations x {config.turns} turns, system prompt "
          f"{config.system_tokens} tokens, arms {','.join(config.arms)}", flush=True)
    arms = {}
    for arm in config.arms:
        arms[arm] = a = run_arm(config, arm, system, users, warmup)
        print(f"  {arm}: {a['tok_s']} tok/s, TTFT p50 by turn "
              f"{[t['ttft_p50_ms'] for t in a['turns']]} ms, prefix hit rate {a['server_prefix_hit_rate']}", flush=True)
    record = {"model": config.model, **start, **check_provenance(start),
              "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "host": host(), "packages": {"metrale_venv": packages()}, "params": asdict(config), "arms": arms}
    if "cache" in arms and "no-cache" in arms:
        on, off = arms["cache"], arms["no-cache"]
        record["ratios"] = {
            "ttft_later_turns_p50_vs_no_cache": round(on["ttft_later_turns_p50_ms"] / off["ttft_later_turns_p50_ms"], 4)
            if on["ttft_later_turns_p50_ms"] and off["ttft_later_turns_p50_ms"] else None,
            "tok_s_vs_no_cache": round(on["tok_s"] / off["tok_s"], 4)}
        print(f"  cache vs no-cache: later turns' TTFT p50 x{record['ratios']['ttft_later_turns_p50_vs_no_cache']} "
              f"(target <= 0.25), tok/s x{record['ratios']['tok_s_vs_no_cache']} (target >= 1.5)", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "chat.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(arms, out_dir / "chat.png", f"{Path(config.model).name} ({config.dtype}, spec {config.spec}): "
                                     f"{config.conversations} chats x {config.turns} turns")
    print(f"wrote {out_dir / 'chat.json'} and {out_dir / 'chat.png'}", flush=True)
    return record
