"""`metrale bench`: argument parsing and the printed table (the sweep lives in bench.benchmark)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_bench_parser(sub) -> None:
    from launch.cli import add_device_args
    b = sub.add_parser("bench", help="concurrency sweep over held-out prompts (or multi-turn chats), arms side by side")
    from launch.cli import DTYPE_HELP, DTYPES
    b.add_argument("--model", default=None, help="checkpoint folder (config.json, *.safetensors, tokenizer.json); "
                   "required unless --compare")
    b.add_argument("--workload", default="sweep", choices=["sweep", "chat", "serve", "serve-vs-vllm"],
                   help="sweep: closed-loop concurrency sweep; chat: conversations over a shared system prompt "
                        "through the server's chat endpoint, prefix cache on and off (arms cache, no-cache); "
                        "serve: running OpenAI-compatible servers (--url) driven in a closed loop; serve-vs-vllm: "
                        "starts metrale serve and vLLM's server (--vllm-python) and drives each in turn with "
                        "vLLM's own `vllm bench serve` client (default: sweep)")
    b.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    add_device_args(b)
    b.add_argument("--quick", action="store_true", help="small sweep that finishes in a few minutes")
    b.add_argument("--concurrency", default=None, metavar="LIST",
                   help="comma list of closed-loop concurrencies, e.g. 1,4,16 (default: 1,2,4,8,16,32; --quick: 1,4)")
    b.add_argument("--arms", default=None, metavar="LIST",
                   help="comma list of arms (default: none). Fixed depths, speculating at every width: none (no "
                        "speculation), k1, k2, k3, k4 (MTP drafts per step), ngram (prompt lookup), tree (the --tree-shape "
                        "tree), treeDIGITS (tree3211: the shape 3,2,1,1); with the model's width cap: ladder (the "
                        "drafts-by-width ladder), ladder+stop (with a 0.5 confidence stop), auto (depth measured "
                        "online); yardsticks: hf (transformers' generate, static cache and compiled), hf-eager (its "
                        "eager generate), vllm and vllm-mtpK (K=1..4, vLLM's CPU build as documented, see "
                        "--vllm-python), vllm-untuned / vllm-mtpK-untuned (the old set-up: an ablation). An engine arm + '-eager' runs without torch.compile "
                        "(none-eager), + '-bi' with the batch-invariant kernels (k3-bi), + '-a2a' at --ep > 1 with "
                        "the MoE exchange instead of auto's choice (none-a2a), + '-dp' with --dp-attention "
                        "(none-dp), + '-tp2' with -dp in attention groups of 2, + '-tbo' with -dp and -eager "
                        "with --two-batch-overlap (none-dp-tbo-eager), + '-twin' a second instance of an "
                        "arm also listed (k3-twin beside k3: their paired ratio, printed as the noise, is what two "
                        "identical arms differ by). Chat workload: no-cache,cache (its default)")
    b.add_argument("--request-kinds", default="plain", metavar="KINDS",
                   help="sweep: comma list of what the requests ask for: plain, json (a JSON schema through the "
                        "grammar mask), penalties; every arm runs each, cells ARM/KIND")
    b.add_argument("--tree-shape", default=None, metavar="COUNTS",
                   help="the draft tree of arm tree, e.g. 1,2,2 (default: none; arm tree needs it)")
    b.add_argument("--ep", type=int, default=1, help="expert-parallel ranks of every engine arm")
    b.add_argument("--launcher", default="mp", choices=["mp", "ray"],
                   help="how --ep > 1 starts its ranks (each arm starts its own group; start-up is not measured)")
    b.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (default: 128; --quick 48; chat 64)")
    b.add_argument("--requests", type=int, default=None, help="requests per cell (default: 2 x concurrency, at least 16)")
    b.add_argument("--repeats", type=int, default=1,
                   help="runs per cell, arms taking turns; the cell is the median run, with min and max beside it")
    b.add_argument("--enforce-eager", action="store_true", help="every engine arm (chat: both servers) runs without torch.compile")
    b.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="arms vllm and vllm-mtpK (K=1..4) run vLLM's CPU build with this venv's Python "
                        "(default: METRALE_VLLM_PYTHON); a yardstick, never a dependency")
    b.add_argument("--prefix-cache", default="off", choices=["off", "both"],
                   help="sweep: the cache policy of every arm: off, or both: ours and vLLM's "
                        "(enable_prefix_caching, 32-token blocks: the least its CPU attention takes) on (default: off)")
    b.add_argument("--compare", nargs=2, type=Path, default=None, metavar=("A.json", "B.json"),
                   help="no run: A's cells over B's, per arm and concurrency; refused between records of different hosts")
    b.add_argument("--json-out", type=Path, default=None, help="where the JSON record goes (default: not written)")
    b.add_argument("--plot-out", type=Path, default=None, help="where the PNG plot goes (default: not drawn)")
    srv = b.add_argument_group("serve workload (--model: the model folder, for its vocabulary)")
    srv.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                     help="a running server to drive, e.g. metrale=http://127.0.0.1:8000 (repeat: they take turns)")
    srv.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request")
    srv.add_argument("--api-key", default=None, help="bearer token the servers ask for (default: none)")
    srv.add_argument("--serve-arm", action="append", default=[], metavar="NAME:ARGS",
                     help="serve-vs-vllm: one more metrale server with these extra serve options, e.g. "
                          "'b512:--max-num-batched-tokens 512', measured in the same turns (repeat for more)")
    srv.add_argument("--no-vllm", action="store_true",
                     help="serve-vs-vllm: leave vLLM's server out (our servers only, with --serve-arm)")
    chat = b.add_argument_group("chat workload")
    chat.add_argument("--conversations", type=int, default=16, help="conversations run at once")
    chat.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    chat.add_argument("--system-tokens", type=int, default=1000, help="tokens of the shared system prompt")
    chat.add_argument("--user-tokens", type=int, default=48, help="tokens of each user message")
    chat.add_argument("--spec", default="none", choices=["none", "mtp", "ngram"], help="speculation of both servers")
    chat.add_argument("--out-dir", type=Path, default=Path("bench-out/chat"), help="where chat.json and chat.png go")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.compare:
        return cmd_compare(*args.compare)
    if args.model is None:
        raise ValueError("bench needs --model DIR (or --compare A.json B.json)")
    if args.workload == "chat":
        return cmd_chat_bench(args)
    if args.workload == "serve":
        return cmd_serve_bench(args)
    if args.workload == "serve-vs-vllm":
        return cmd_serve_vs_vllm(args)
    from bench.benchmark import BenchConfig, run_bench

    conc = args.concurrency or ("1,4" if args.quick else "1,2,4,8,16,32")
    try:
        levels = [int(c) for c in conc.split(",")]
    except ValueError:
        raise ValueError(f"--concurrency {conc!r} is not a comma list of integers") from None
    config = BenchConfig(model=args.model, dtype=args.dtype, arms=arm_list(args.arms or "none"),
                         concurrency=tuple(levels), ep=args.ep, launcher=args.launcher,
                         max_tokens=args.max_tokens or (48 if args.quick else 128),
                         requests=args.requests, repeats=args.repeats, quick=args.quick,
                         tree_shape=args.tree_shape, enforce_eager=args.enforce_eager, device=args.device,
                         request_kinds=tuple(k.strip() for k in args.request_kinds.split(",")),
                         vllm_python=args.vllm_python, prefix_cache=args.prefix_cache)
    from launch import launcher_for
    run_bench(config, json_out=args.json_out, plot_out=args.plot_out,
              launcher=launcher_for(args.launcher) if config.ep > 1 else None)
    return 0


def arm_list(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(","))


def cmd_chat_bench(args: argparse.Namespace) -> int:
    from bench.chat import ChatBenchConfig, run_chat_bench

    config = ChatBenchConfig(model=args.model, dtype=args.dtype, device=args.device, conversations=args.conversations, turns=args.turns,
                             system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                             max_tokens=args.max_tokens or 64, spec=args.spec,
                             arms=arm_list(args.arms or "no-cache,cache"), enforce_eager=args.enforce_eager)
    run_chat_bench(config, args.out_dir)
    return 0


def cmd_compare(a: Path, b: Path) -> int:
    """Two records' cells side by side: A / B per arm and concurrency (bench.cells.record_ratios)."""
    import json
    from bench.cells import record_ratios
    records = []
    for path in (a, b):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--compare {path}: not a bench record ({exc})") from None
    for r in record_ratios(*records, names=(str(a), str(b))):
        print(f"{r['arm']} c={r['concurrency']}: {r['a_tok_s']:.1f} / {r['b_tok_s']:.1f} = "
              f"{'tie' if r['tie'] else format(r['ratio'], '.3f')} [{r['range'][0]:.2f}-{r['range'][1]:.2f}]")
    return 0


def cmd_serve_vs_vllm(args: argparse.Namespace) -> int:
    from bench.serve.vs_vllm import ServeVsVLLMConfig, run_serve_vs_vllm
    from bench.vllm_arm import vllm_python

    conc = args.concurrency or "1,16"
    try:
        levels = tuple(int(c) for c in conc.split(","))
    except ValueError:
        raise ValueError(f"--concurrency {conc!r} is not a comma list of integers") from None
    config = ServeVsVLLMConfig(model=args.model, vllm_python=vllm_python(args.vllm_python),
                               dtype=args.dtype, concurrency=levels,
                               requests={c: args.requests for c in levels} if args.requests else {},
                               input_len=args.input_len, output_len=args.max_tokens or 64,
                               repeats=args.repeats, prefix_cache=args.prefix_cache,
                               arms=tuple(args.serve_arm), vllm=not args.no_vllm)
    run_serve_vs_vllm(config, json_out=args.json_out, plot_out=args.plot_out)
    return 0


def cmd_serve_bench(args: argparse.Namespace) -> int:
    import json

    from bench.serve.workload import ServeWorkloadConfig, parse_servers, run_serve_workload

    cfg = Path(args.model) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"--model {args.model!r}: no config.json there (the serve workload reads the vocabulary size)")
    model = json.loads(cfg.read_text())
    eos = model.get("eos_token_id")
    conc = args.concurrency or ("1,4" if args.quick else "1,16")
    try:
        levels = tuple(int(c) for c in conc.split(","))
    except ValueError:
        raise ValueError(f"--concurrency {conc!r} is not a comma list of integers") from None
    config = ServeWorkloadConfig(servers=parse_servers(args.url), vocab_size=int(model["vocab_size"]),
                                 avoid_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                                 concurrency=levels, requests=args.requests, input_len=args.input_len,
                                 output_len=args.max_tokens or 64, repeats=args.repeats, api_key=args.api_key)
    run_serve_workload(config, json_out=args.json_out, plot_out=args.plot_out)
    return 0
