"""The `metrale` command line (`python -m launch` is the same): generate, bench."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class UsageError(ValueError):
    """Bad command-line input; printed as one line, exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help says it already (or the option
    is a switch that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.required or default is argparse.SUPPRESS
                or "(default" in text or "Default:" in text
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))):
            return text
        if isinstance(action, argparse.BooleanOptionalAction):
            shown = {True: "on", False: "off"}.get(default, "see above")
        else:
            shown = "none" if default is None else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (`metrale serve: error: ...`), exit status 2, and
    every option's default in its help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds above 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds, at least 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in (0, 1]")
    return value


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]",
                   help="where weights, KV cache and every step tensor live (auto: CUDA when present); "
                        "each EP rank takes its own local GPU")


DTYPES = ["auto", "float32", "bfloat16", "float64"]
DTYPE_HELP = ("auto: the model config's dtype on a GPU (float16 served as bfloat16), float32 on a CPU (the dtype "
              "the CPU records and the embedded model's tuned defaults were measured in first; bfloat16 drafts "
              "less, see the model's metrale.toml)")
DEFAULT_NUM_DRAFTS = 3


def model_defaults_help(model_dir: Path | None) -> tuple[str, str]:
    """The help's words for the ladder's and the width cap's defaults: where they come from, and,
    when --model names a folder on the command line, the values its metrale.toml gives."""
    from speculative.ladder import DEFAULT_MTP_K_LADDER, DEFAULT_MTP_MAX_SEQS
    ladder = f"the model folder's metrale.toml [behavior] mtp_k_ladder, else {DEFAULT_MTP_K_LADDER}"
    cap = f"the model folder's metrale.toml [behavior] mtp_max_seqs, else {DEFAULT_MTP_MAX_SEQS}"
    if model_dir is None:
        see = " (--model DIR before --help shows the folder's values)"
        return ladder + see, cap + see
    if not (model_dir / "metrale.toml").is_file():
        return ladder, cap
    from runtime.model.config import BEHAVIOR_DTYPES, ConfigError, load_behavior
    try:
        by_dtype = {d: load_behavior(model_dir, d) for d in (None, *BEHAVIOR_DTYPES)}
    except ConfigError:
        return ladder, cap

    def values(key: str, fallback: object) -> str:
        shared = by_dtype[None].get(key, fallback)
        extra = [f"{d} {v[key]}" for d, v in by_dtype.items() if d is not None and v.get(key, shared) != shared]
        return f"{shared}" + (f" ({', '.join(extra)})" if extra else "")

    where = f" (here {model_dir / 'metrale.toml'}: "
    return (ladder + where + values("mtp_k_ladder", DEFAULT_MTP_K_LADDER) + ")",
            cap + where + values("mtp_max_seqs", DEFAULT_MTP_MAX_SEQS) + ")")


def add_model_args(p: argparse.ArgumentParser, model_dir: Path | None = None) -> None:
    """The model, device and speculation options of generate and serve. `model_dir`: the folder
    named by --model on the command line, whose metrale.toml defaults the help then shows."""
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    add_device_args(p)
    p.add_argument("--kv-cache-tokens", type=_positive_int, default=32768, help="KV cache budget in tokens")
    p.add_argument("--block-size", type=_positive_int, default=16,
                   help="tokens per KV block, the prefix cache's unit (vLLM's --block-size); other than 16 with "
                        "--ep 1 only (default: 16)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="FRACTION",
                   help="CUDA only: size the KV cache to what is left of this share of the GPU's memory after "
                        "the weights (replaces --kv-cache-tokens; refused on the CPU)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=1024,
                   help="most tokens in one step (decode rows, prefill chunks and drafts together); a longer "
                        "prompt is prefilled in chunks over several steps (vLLM's flag; default: 1024)")
    p.add_argument("--spec", default="none", choices=["none", "mtp", "ngram"],
                   help="speculative decoding: the checkpoint's MTP layer, prompt lookup, or none")
    p.add_argument("--num-drafts", type=int, default=None,
                   help=f"with --spec: the most draft tokens per sequence per step, 0..16 (default "
                        f"{DEFAULT_NUM_DRAFTS}; the ladder and the width cap lower it by running width)")
    ladder, cap = model_defaults_help(model_dir)
    p.add_argument("--mtp-k-ladder", default=None, metavar="N:K[,N:K...]|auto",
                   help="drafts by running width, n_max:drafts[,...], or auto (measured online). Default: "
                        + ladder)
    p.add_argument("--mtp-max-seqs", type=int, default=None, metavar="N",
                   help="speculate only while at most this many sequences run (1..128); above it every sequence "
                        "decodes plainly and the log says so. Default: " + cap)
    p.add_argument("--draft-confidence-stop", type=float, default=None, metavar="TAU",
                   help="stop extending a draft chain once a draft's top-1 probability is below TAU")
    p.add_argument("--tree-shape", default=None, metavar="COUNTS",
                   help="draft trees with --spec mtp: candidates per depth, e.g. 1,2,2 (each 1..4, at most 7 nodes)")
    p.add_argument("--spec-verify", default="exact", choices=["exact", "rejection"],
                   help="exact: keyed target draws (same tokens as no speculation); rejection: rejection sampling")
    p.add_argument("--ep", type=_positive_int, default=None, help="expert-parallel ranks (default: 1, or torchrun's world size)")
    p.add_argument("--launcher", default="ray", choices=["ray", "mp"],
                   help="how --ep > 1 starts its worker ranks: Ray actors or spawned processes (mp: a script that uses "
                        "it from Python must start it under if __name__ == '__main__':)")
    p.add_argument("--ray-address", default=None,
                   help="a running Ray cluster (default: RAY_ADDRESS, else a local Ray started here)")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_SPREAD"],
                   help="how Ray places the ranks' bundles over nodes")
    p.add_argument("--ray-temp-dir", default=None,
                   help="where a local Ray keeps its logs and temp files (default: Ray's own, under /tmp/ray)")
    p.add_argument("--ray-usage-stats", action="store_true", help="let Ray send usage statistics (off by default)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of the EP group after a rank dies before giving up (0: none)")
    p.add_argument("--warm-standby", action=argparse.BooleanOptionalAction, default=True,
                   help="keep one spawned worker per rank with its shard loaded, so a restart of the EP group "
                        "needs no cold start (mp; Ray on CPU); --no-warm-standby saves that memory")
    p.add_argument("--moe-a2a", default="auto", choices=["auto", "alltoall", "allreduce"],
                   help="MoE dispatch at EP > 1: allreduce (one collective a layer), alltoall (the exchange), or auto "
                        "(allreduce, except batch-invariant with more than two experts a token)")
    p.add_argument("--eplb-redundant-experts", type=int, default=None, metavar="R",
                   help="with --ep N: EPLB, R redundant copies of the hottest experts over N ranks ((experts + R) "
                        "divisible by N; 0: no copies), and per-expert load counters in /metrics")
    p.add_argument("--eplb-interval-steps", type=int, default=None, metavar="S",
                   help="with --eplb-redundant-experts: re-place the experts from the counted loads every S steps "
                        "while serving (weights move between ranks; tokens unchanged)")
    p.add_argument("--dp-attention", action="store_true",
                   help="with --ep N: data-parallel attention; each rank attends over its own sequences (and runs "
                        "the dense layers and LM head over their rows) and the routed experts exchange rows "
                        "all-to-all, padded to a fixed row budget in decode (docs/design.md §4.3)")
    p.add_argument("--attention-tp", type=_positive_int, default=1, metavar="K",
                   help="with --dp-attention: groups of K ranks (a power of two dividing --ep) share their sequences "
                        "and split attention heads tensor-parallel among them (default 1)")
    p.add_argument("--two-batch-overlap", action="store_true",
                   help="with --dp-attention (and --enforce-eager): run each rank's rows as two micro-batches, one's "
                        "expert exchange in flight while the other computes (docs/design.md §4.3)")
    p.add_argument("--ep-timeout", type=float, default=60.0, metavar="S",
                   help="seconds before a collective is declared dead")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run the target step eagerly: no torch.compile and no CUDA graph capture "
                        "on every rank (float64 always runs eager)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels: a request's tokens do not depend on what shares its steps "
                        "(width, speculation, other requests); compiled unless --enforce-eager, and a group's "
                        "ranks compile or run eager alike. Default: on for float64 only")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt whole (default: full KV blocks of earlier prompts are reused)")


def _model_on_command_line(argv: list[str] | None) -> Path | None:
    """The folder --model names in `argv` (for the help's model defaults), or None."""
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        text = argv[i + 1] if arg == "--model" and i + 1 < len(argv) else arg.partition("=")[2] \
            if arg.startswith("--model=") else None
        if text and Path(text).is_dir():
            return Path(text)
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; a --model folder in `argv` puts its metrale.toml defaults in the help."""
    model_dir = _model_on_command_line(argv)
    ap = Parser(prog="metrale", description="Serve and benchmark MoE language models.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="generate continuations of prompts offline")
    add_model_args(g, model_dir)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one text prompt")
    src.add_argument("--prompts-file", type=Path,
                     help='JSONL, one {"prompt": "..."} or {"prompt_ids": [...]} per line; served as one batch')
    g.add_argument("--max-tokens", type=int, default=64,
                   help="most tokens generated per prompt; more than the context leaves is refused")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches TOP_P")
    g.add_argument("--top-k", type=int, default=0, help="keep the TOP_K likeliest tokens (0: all)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampled tokens (keyed by position: the same tokens with and without "
                        "speculation; default: unseeded)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below MIN_P times the top probability")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once per output token seen (-2..2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence in the output (-2..2)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides positive / multiplies negative logits of prompt and output tokens (1: off)")
    g.add_argument("--min-tokens", type=int, default=0, help="hold EOS and stop strings back for this many tokens")
    g.add_argument("--logit-bias", action="append", default=None, metavar="TOKEN_ID=BIAS",
                   help="add BIAS (-100..100) to a token's logit (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, in input order")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(s, model_dir)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on (checked before the model loads)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: the folder name)")
    s.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on /v1 routes (default: no key)")
    s.add_argument("--max-waiting", type=_positive_int, default=None, metavar="N",
                   help="most sequences waiting for a place in the batch; beyond it a request is a 503 with "
                        "Retry-After (default 512)")
    s.add_argument("--request-timeout", type=_positive_float, default=None, metavar="S",
                   help="end a request unfinished S seconds after it arrived (waiting or running) and free its "
                        "cache: a 504, or finish reason 'timeout' on a stream (default: no limit)")
    s.add_argument("--drain-timeout", type=_non_negative_float, default=None, metavar="S",
                   help="on SIGTERM or Ctrl-C, how long open requests may still run before they are ended with "
                        "finish reason 'shutdown' (default 30)")
    add_chat_args(s)

    from launch.bench_cli import add_bench_parser
    add_bench_parser(sub)
    return ap


def add_chat_args(s: argparse.ArgumentParser) -> None:
    """Chat options of `serve` (serving.chat): the template, the tool-call and reasoning parsers."""
    from serving.reasoning import PARSER_NAMES as REASONING
    from serving.tool_parsers import PARSER_NAMES as TOOLS
    s.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file (default: the model folder's chat_template.jinja or "
                        "tokenizer_config.json's, else the GLM-4.5 format)")
    s.add_argument("--tool-call-parser", choices=(*TOOLS, "none"), default=None,
                   help="how tool calls in the output are read (default: the model family's: GLM glm45, "
                        "Qwen3 hermes, DeepSeek deepseek_v31)")
    s.add_argument("--reasoning-parser", choices=REASONING, default=None,
                   help="how <think> blocks become reasoning_content (default: the model family's: GLM glm45, "
                        "Qwen3 qwen3, DeepSeek deepseek_r1)")


def chat_parsers(model: str, tool: str | None, reasoning: str | None) -> tuple[str | None, str | None]:
    """The tool-call and reasoning parsers: those asked for, else the model family's (none when the
    folder has no config.json of a known family)."""
    from runtime.model.families import family_of
    from serving.reasoning import DEFAULT_PARSERS as REASONING
    from serving.tool_parsers import DEFAULT_PARSERS as TOOLS
    model_type = None
    try:
        model_type = family_of(json.loads((Path(model) / "config.json").read_text())).model_type
    except (OSError, ValueError):
        pass
    tool = tool or TOOLS.get(model_type, "none")
    reasoning = reasoning or REASONING.get(model_type, "none")
    return (None if tool == "none" else tool), (None if reasoning == "none" else reasoning)


def read_prompts(path: Path) -> list[str | list[int]]:
    if not path.is_file():
        raise UsageError(f"prompts file {str(path)!r} does not exist")
    prompts: list[str | list[int]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt_ids"), list) \
                and all(isinstance(t, int) for t in obj["prompt_ids"]):
            prompts.append(obj["prompt_ids"])
        else:
            raise UsageError(f'{path}:{lineno}: expected {{"prompt": "..."}} or {{"prompt_ids": [ints]}}')
    if not prompts:
        raise UsageError(f"prompts file {path} holds no prompt")
    return prompts


def parse_logit_bias(items: list[str] | None) -> dict[int, float] | None:
    """`--logit-bias TOKEN_ID=BIAS` items -> {token id: bias} (later items win)."""
    if not items:
        return None
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            if not sep or not token.strip().isdigit():
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise UsageError(f"--logit-bias {item!r}: expected TOKEN_ID=BIAS, e.g. 42=-5.5") from None
    return bias


def sampling_params(args: argparse.Namespace):
    """The generate flags -> SamplingParams; a bad value is a UsageError naming its flag."""
    from runtime.sample.sampler import SamplingParamError, SamplingParams
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              max_tokens=args.max_tokens, min_tokens=args.min_tokens, seed=args.seed,
                              ignore_eos=args.ignore_eos, stop=args.stop, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                              logit_bias=parse_logit_bias(args.logit_bias))
    except SamplingParamError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {exc}") from None


def resolve_speculation(args: argparse.Namespace):
    """Resolve the speculation settings once (flags > published > environment > the model's
    metrale.toml > default) and publish the ladder, the width cap and the confidence stop, as
    the seed's API asks; returns the `SpecSettings` every layer below is given."""
    from speculative.draft_stop import set_draft_confidence_stop
    from speculative.ladder import set_mtp_k_ladder, set_mtp_max_seqs
    from speculative.settings import resolve_spec_settings

    if args.num_drafts is not None and args.spec == "none":
        raise UsageError(f"--num-drafts {args.num_drafts} needs --spec mtp or --spec ngram (without --spec nothing "
                         "is drafted)")
    num_drafts = DEFAULT_NUM_DRAFTS if args.num_drafts is None else args.num_drafts
    if args.tree_shape is not None:
        if args.spec != "mtp":
            raise UsageError(f"--tree-shape {args.tree_shape} needs --spec mtp (hedges are the drafter's next-best "
                             "tokens)")
        if args.spec_verify != "exact":
            raise UsageError(f"--tree-shape verifies with keyed target draws only, not --spec-verify {args.spec_verify}")
    spec = resolve_spec_settings(method=args.spec, num_drafts=num_drafts, k_ladder=args.mtp_k_ladder,
                                 width_cap=args.mtp_max_seqs, confidence_stop=args.draft_confidence_stop,
                                 tree_shape=args.tree_shape, verify=args.spec_verify,
                                 model_dir=args.model if Path(args.model).is_dir() else None,
                                 dtype=getattr(args, "dtype", None))
    if args.mtp_k_ladder is not None and args.mtp_k_ladder.strip() != "auto":
        set_mtp_k_ladder(args.mtp_k_ladder)
    set_mtp_max_seqs(spec.width_cap, spec.width_cap_source)
    if spec.confidence_stop is not None:
        set_draft_confidence_stop(spec.confidence_stop)
    return spec


def resolve_dtype(dtype: str, model: str, device: str) -> str:
    """`--dtype auto`: on a GPU the dtype of the model's config.json (`dtype`, or `torch_dtype`;
    float16, which Metrale does not serve, as bfloat16; float32 when it names none), on a CPU
    float32. Any other value is kept."""
    if dtype != "auto":
        return dtype
    from runtime.platform.device import resolve_device
    if resolve_device(device).type != "cuda":
        return "float32"
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return "float32"    # the model's loading says what is wrong with the folder
    named = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    return {"float16": "bfloat16", "half": "bfloat16", "bfloat16": "bfloat16", "float64": "float64"}.get(named,
                                                                                                        "float32")


def make_llm(args: argparse.Namespace):
    """The LLM of rank 0: single process, an mp or Ray group, or a torchrun group. None on
    torchrun worker ranks, which serve rank 0's commands until it shuts them down."""
    from launch import launcher_for
    from launch.torchrun import join, run_worker, torchrun_rank
    from runtime.platform.device import resolve_device
    from serving import LLM

    device = resolve_device(args.device)
    if args.gpu_memory_utilization is not None and device.type != "cuda":
        raise UsageError(f"--gpu-memory-utilization sizes the KV cache from free GPU memory; on {device} use "
                         "--kv-cache-tokens")
    spec = resolve_speculation(args)
    common = dict(dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens, kv_block_size=args.block_size,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization, spec_settings=spec, moe_a2a=args.moe_a2a, ep_timeout_s=args.ep_timeout,
                  enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant,
                  prefix_cache=args.prefix_cache, eplb_redundant_experts=args.eplb_redundant_experts,
                  eplb_interval_steps=args.eplb_interval_steps, dp_attention=args.dp_attention,
                  attention_tp=args.attention_tp, two_batch_overlap=args.two_batch_overlap)
    tr = torchrun_rank()
    if tr is not None:
        rank, world = tr
        if args.ep is not None and args.ep != world:
            raise UsageError(f"--ep {args.ep} conflicts with torchrun's world size {world}")
        if not Path(args.model).is_dir():
            raise UsageError(f"model folder {args.model!r} does not exist")
        comm = join(rank, world, args.ep_timeout, device)
        if rank > 0:
            from ep.parallel import dp_mode
            code = run_worker(comm, args.model, args.dtype, dp_mode(args.attention_tp) if args.dp_attention else args.moe_a2a,
                              args.kv_cache_tokens,
                              args.gpu_memory_utilization)
            if code:
                raise SystemExit(code)
            return None
        return LLM(model=args.model, comm=comm, **common)
    ep = args.ep or 1
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts} must be at least 0")
    launcher = None
    if ep > 1:
        from launch.ray_group import RayOptions
        ray_options = RayOptions(address=args.ray_address, placement_strategy=args.placement_strategy,
                                 temp_dir=args.ray_temp_dir, usage_stats=args.ray_usage_stats)
        launcher = launcher_for(args.launcher, ray_options=ray_options)
    if ep > 1 and args.launcher == "mp":
        from runtime.platform.device import check_local_gpus
        check_local_gpus(device, ep)
    return LLM(model=args.model, ep=ep, launcher=launcher, max_restarts=args.max_restarts, device=str(device),
               warm_standby=args.warm_standby, **common)


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    params = sampling_params(args)
    prompts = read_prompts(args.prompts_file) if args.prompts_file else [args.prompt]
    llm = make_llm(args)
    if llm is None:  # a torchrun worker rank: it served rank 0 and prints nothing
        return 0
    try:
        check_prompts(llm, prompts, params)   # refused before any compile, as the server refuses them
        t0 = time.perf_counter()
        llm.deployment.warm_up()              # the compile, timed apart from the generation
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    except BaseException:
        llm.shutdown(graceful=False)   # an error or Ctrl-C mid-step leaves an EP group unusable
        raise
    llm.shutdown()
    for i, out in enumerate(outputs):
        if args.json:
            print(json.dumps({"index": out.index, "token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason, "num_verifies": out.num_verifies,
                              "drafted_tokens": out.drafted_tokens, "accepted_tokens": out.accepted_tokens}))
        else:
            if len(outputs) > 1:
                print(f"{'' if i == 0 else chr(10)}----- output {i + 1} of {len(outputs)} "
                      f"({out.finish_reason}, {len(out.token_ids)} tokens) -----")
            print(out.text)
    if llm.deployment.compile_report is not None:
        print(f"[{llm.deployment.compile_report}]", file=sys.stderr)
    if (fmt := quantized_weights(llm)) is not None:
        print(f"[weights: {fmt}]", file=sys.stderr)
    if not args.json:
        n = sum(len(o.token_ids) for o in outputs)
        line = f"[{len(outputs)} prompt(s), {n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s generating"
        line += f"; the compile before it took {compile_s:.1f} s" if llm.deployment.compile_report is not None else ""
        verifies = sum(o.num_verifies for o in outputs)
        if verifies:
            line += f", accept_len {1 + sum(o.accepted_tokens for o in outputs) / verifies:.2f}"
        print(line + "]", file=sys.stderr)
    graphs = getattr(llm.deployment.runner, "graphs", None)
    if graphs is not None and graphs.capture:
        s = graphs.summary()
        print(f"[cuda graphs: {s['captured']} captured, pool {s['pool_mib']} MiB, {s['replays']} replays]",
              file=sys.stderr)
    if len(llm.rank_weight_bytes) > 1:
        print("[weights per rank: " + ", ".join(f"rank {r}: {b / 2**20:.1f} MiB"
                                                for r, b in enumerate(llm.rank_weight_bytes)) + "]", file=sys.stderr)
    return 0


def check_prompts(llm, prompts: list[str | list[int]], params) -> None:
    """Refuse, in one line, a prompt the engine would refuse or a --max-tokens past what the
    context leaves after a prompt (the server's 400; the engine would stop there silently)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        ids = llm.encode(prompt)
        engine.validate_request(ids, params)
        room = engine.max_model_len - len(ids)
        if params.max_tokens > room:
            which = f"prompt {i + 1}'s" if len(prompts) > 1 else "the prompt's"
            raise UsageError(f"--max-tokens {params.max_tokens} exceeds the {room} tokens left in the context of "
                             f"{engine.max_model_len} after {which} {len(ids)} tokens")


def check_port(host: str, port: int) -> None:
    """Refuse, in one line, a port this host cannot listen on (another server holds it), by binding
    it as uvicorn will (SO_REUSEADDR) and letting it go at once."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror} (is another server running there? "
                             "pick another --port)") from None


def quantized_weights(llm) -> str | None:
    """How a quantized checkpoint's weights are served (runtime.model.quantization), None for a plain one."""
    fmt = getattr(llm.deployment.runner.model, "weight_format", "")
    return fmt if fmt.startswith("fp8") else None


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (or Ctrl-C): drain (serving.lifecycle), stop every EP rank, exit 0."""
    from serving.async_engine import QueueLimits
    from serving.chat_template import load_chat_template
    from serving.server import ServerConfig, serve

    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a TCP port")
    check_port(args.host, args.port)     # before the model loads and compiles
    name = args.served_model_name or Path(args.model).resolve().name
    given = {k: v for k, v in (("max_waiting", args.max_waiting), ("request_timeout_s", args.request_timeout))
             if v is not None}
    drain_kw = {} if args.drain_timeout is None else {"drain_timeout_s": args.drain_timeout}
    try:
        template = load_chat_template(Path(args.model), args.chat_template) \
            if Path(args.model).is_dir() or args.chat_template else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    tool_parser, reasoning_parser = chat_parsers(args.model, args.tool_call_parser, args.reasoning_parser)
    config = ServerConfig(served_model_name=name, api_key=args.api_key, chat_template=template,
                          tool_call_parser=tool_parser, reasoning_parser=reasoning_parser,
                          limits=QueueLimits(**given), **drain_kw)
    llm = make_llm(args)
    if llm is None:
        return 0
    llm.deployment.warm_up()   # compiled steps compile now, not in the first requests
    if llm.deployment.compile_report is not None:
        print(f"metrale serve: {llm.deployment.compile_report}", file=sys.stderr, flush=True)
    if (fmt := quantized_weights(llm)) is not None:
        print(f"metrale serve: weights: {fmt}", file=sys.stderr, flush=True)
    print(f"metrale serve: {name} on http://{args.host}:{args.port} (spec {args.spec})", file=sys.stderr, flush=True)
    try:
        drain = serve(llm, host=args.host, port=args.port, config=config)
    finally:
        llm.shutdown(graceful=llm.deployment.pending() is None)
    print(f"metrale serve: stopped ({drain.num_ended} request(s) ended by the drain)", file=sys.stderr, flush=True)
    return 0


def _show_speculation_notices() -> None:
    """The depth policy's one-line notices (speculation paused above the width cap, a ladder step
    below the drafts asked; speculative.depth) go to stderr as `metrale: ...`."""
    import logging
    log = logging.getLogger("metrale.spec")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("metrale: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def leave(code: int) -> int:
    """The exit code of a finished command. Under torchrun the process leaves at once: its gloo
    group's threads are still joinable at interpreter teardown, which then aborts
    (std::terminate, SIGABRT) on some runs and fails the whole torchrun job after a clean run."""
    from launch.torchrun import torchrun_rank
    if torchrun_rank() is None:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:   # Ctrl-C at any point (an EP group's worker ranks ignore it)
        print(f"metrale {args.command}: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    _show_speculation_notices()
    from engine.engine import RequestError
    from ep.channel import CommandRefused, HandshakeError
    from ep.comm import CommError
    from runtime.model.config import ConfigError
    from runtime.model.weights import CheckpointError
    from serving.deployment import GroupFailed, GroupStartError
    try:
        if getattr(args, "dtype", None) == "auto":
            args.dtype = resolve_dtype(args.dtype, args.model, args.device)
        if args.command == "generate":
            return leave(cmd_generate(args))
        if args.command == "serve":
            return leave(cmd_serve(args))
        from launch.bench_cli import cmd_bench
        return cmd_bench(args)
    except (UsageError, RequestError, ConfigError, CheckpointError, FileNotFoundError, ValueError,
            CommError, HandshakeError, CommandRefused, GroupFailed, GroupStartError) as exc:
        print(f"metrale {args.command}: error: {exc}", file=sys.stderr)
        if isinstance(exc, (CommError, HandshakeError, CommandRefused, GroupFailed)):
            # A broken process group leaves torch's communication threads unjoinable, and the
            # interpreter's teardown then aborts (std::terminate). The error is printed: leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        return 2
