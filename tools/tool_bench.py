"""Tokens/s and MTP acceptance under a tool-call grammar against unconstrained generation.

    python tools/tool_bench.py --model models/tiny-glm-moe --out bench/records/tool_grammar

Chat prompts rendered with two tools through the model's chat template (serving.chat_template);
arms: {plain, MTP k drafts} x {free text, tool_choice naming a function (its parameters' JSON
schema as the grammar), tool_choice required (serving.chat.required_schema)} at concurrency 1 and
16, greedy, the arms interleaved within each repeat; the median of the repeats. tok/s counts output
tokens over the wall time of the batch (prefill included), decode tok/s the tokens after each
sequence's first over the time after the last first token; acceptance length is committed tokens
per verify ((accepted + verifies) / verifies). Writes OUT.json and OUT.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.sample.grammar import StructuredOutput  # noqa: E402
from runtime.sample.sampler import SamplingParams  # noqa: E402
from serving.chat import required_schema  # noqa: E402
from serving.chat_template import load_chat_template  # noqa: E402
from serving.llm import LLM  # noqa: E402

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 14}}}
SEARCH = {"type": "object", "additionalProperties": False, "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 24}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Rome", "Accra", "Hanoi", "Perth", "Bern", "Riga",
          "Baku", "Doha", "Suva", "Kyiv"]
GRAMMARS = {"free": None, "named": StructuredOutput.json_schema(WEATHER),
            "required": StructuredOutput.json_schema(required_schema({"get_weather": WEATHER, "search": SEARCH},
                                                                     False))}


def run(llm: LLM, prompts: list[list[int]], grammar: StructuredOutput | None, max_tokens: int) -> dict:
    m = llm.engine.metrics
    v0, a0 = m.verifies, m.accepted_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0, structured=grammar)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    verifies, accepted = m.verifies - v0, m.accepted_tokens - a0
    prefilled = max(o.ttft_s for o in outs)       # from here on the batch only decodes
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "decode_tok_s": sum(len(o.token_ids) - 1 for o in outs) / (wall - prefilled),
            "accept_len": (accepted + verifies) / verifies if verifies else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-glm-moe")
    ap.add_argument("--out", default="bench/records/tool_grammar")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--enforce-eager", action="store_true", help="no compiled step (a quick check)")
    args = ap.parse_args()
    model = Path(args.model)
    template = load_chat_template(model)
    llms = {"plain": LLM(model, args.dtype, kv_cache_tokens=8192, enforce_eager=args.enforce_eager),
            "mtp": LLM(model, args.dtype, kv_cache_tokens=8192, spec="mtp", num_drafts=args.num_drafts,
                       draft_policy="fixed", mtp_max_seqs=64, enforce_eager=args.enforce_eager)}
    tok = llms["plain"].engine.tokenizer
    prompts = [tok.encode(template.render([{"role": "user", "content": f"What is the weather in {c} this week?"}],
                                          tools=TOOLS), add_special_tokens=False) for c in CITIES]
    widths = [int(c) for c in args.concurrency.split(",")]
    for llm in llms.values():           # warm-up at every width: compiled shapes, grammar tables
        for width in widths:
            for g in GRAMMARS.values():
                run(llm, prompts[:width], g, 16)
    cells: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for width in widths:
            for spec, llm in llms.items():
                for name, g in GRAMMARS.items():
                    cells.setdefault(f"{spec}/{name}/c{width}", []).append(run(llm, prompts[:width], g, args.max_tokens))
    rows = []
    for key, runs in cells.items():
        spec, name, width = key.split("/")
        acc = [r["accept_len"] for r in runs if r["accept_len"] is not None]
        rows.append({"spec": spec, "grammar": name, "concurrency": int(width[1:]),
                     "tok_s_median": statistics.median(r["tok_s"] for r in runs),
                     "tok_s_all": [round(r["tok_s"], 1) for r in runs],
                     "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in runs),
                     "decode_tok_s_all": [round(r["decode_tok_s"], 1) for r in runs],
                     "tokens": runs[0]["tokens"], "accept_len": statistics.median(acc) if acc else None})
    for r in rows:
        base = next(x for x in rows if x["spec"] == "plain" and x["grammar"] == "free"
                    and x["concurrency"] == r["concurrency"])
        r["vs_plain_free"] = r["tok_s_median"] / base["tok_s_median"]
        r["decode_vs_plain_free"] = r["decode_tok_s_median"] / base["decode_tok_s_median"]
    record = {"what": "tool-call grammar vs unconstrained, plain vs MTP", "model": str(model), "dtype": args.dtype,
              "num_drafts": args.num_drafts, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "greedy": True, "load_average_at_end": list(os.getloadavg()), "rows": rows}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    for r in rows:
        al = f"{r['accept_len']:.2f}" if r["accept_len"] else "-"
        print(f"{r['spec']:5} {r['grammar']:8} c{r['concurrency']:<3} {r['tok_s_median']:7.1f} tok/s "
              f"(x{r['vs_plain_free']:.2f}), decode {r['decode_tok_s_median']:7.1f} tok/s "
              f"(x{r['decode_vs_plain_free']:.2f}) accept_len {al} tokens {r['tokens']}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(widths), figsize=(5 * len(widths), 4), squeeze=False)
    for ax, width in zip(axes[0], widths):
        sel = [r for r in rows if r["concurrency"] == width]
        labels = [f"{r['spec']}\n{r['grammar']}" for r in sel]
        ax.bar(labels, [r["decode_tok_s_median"] for r in sel],
               color=["#888" if r["spec"] == "plain" else "#37c" for r in sel])
        for i, r in enumerate(sel):
            if r["accept_len"]:
                ax.text(i, r["decode_tok_s_median"], f"AL {r['accept_len']:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"concurrency {width} ({args.dtype}, greedy)")
        ax.set_ylabel("decode tok/s (median of repeats)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
