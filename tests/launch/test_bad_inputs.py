"""Every bad input we know of, in one table: HTTP bodies and headers, CLI flags, METRALE_*
variables, model folders. Each gives one clear line (an HTTP error body naming the problem, a
one-line `metrale <command>: error: ...`, a one-line warning for a variable that keeps its
documented fallback), and the server answers /health with 200 after every HTTP one.

The EP command channel's refusals (bad words on the wire) are covered by the tests in tests/ep.
docs/reliability.md, section "Bad input", lists this table.
"""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import ROOT, metrale_cmd, run_env
from tests.launch.test_server import http, start_server, stop_server

EMBEDDED = ROOT / "models" / "tiny-glm-moe"
API_KEY = "sk-test-123"      # start_server's
MODEL = "tiny"               # start_server's served name
JSON_AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "x", **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@dataclass(frozen=True)
class Http:
    """POST (unless `method`) to `path`; the answer is `status` and its error message holds `needle`."""
    name: str
    data: bytes | None
    status: int
    needle: str
    path: str = "/v1/completions"
    headers: dict = field(default_factory=lambda: JSON_AUTH)
    method: str = "POST"


HTTP = [
    Http("malformed-json", b"{not json", 400, "malformed JSON body"),
    Http("not-utf8", b"\xff\xfe{}", 400, "malformed JSON body"),
    Http("json-array-body", b"[1, 2]", 400, "request body must be a JSON object"),
    Http("json-string-body", b'"hello"', 400, "request body must be a JSON object"),
    Http("wrong-content-type", body(), 415, "Content-Type 'text/plain' is not supported",
         headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "text/plain"}),
    Http("form-content-type", b"prompt=x", 415, "application/x-www-form-urlencoded",
         headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/x-www-form-urlencoded"}),
    Http("oversized-body", body(prompt="x" * (2 << 20)), 413, "exceeds 1048576"),
    Http("missing-api-key", body(), 401, "invalid or missing API key", headers={"Content-Type": "application/json"}),
    Http("wrong-api-key", body(), 401, "invalid or missing API key",
         headers={"Authorization": "Bearer nope", "Content-Type": "application/json"}),
    Http("missing-model", json.dumps({"prompt": "x"}).encode(), 400, "'model'"),
    Http("unknown-model", body(model="other"), 404, "model 'other' does not exist"),
    Http("missing-prompt", json.dumps({"model": MODEL}).encode(), 400, "'prompt'"),
    Http("empty-prompt", body(prompt=""), 400, "prompt"),
    Http("prompt-too-long", body(prompt="word " * 3000), 400, "does not fit the context"),
    Http("token-outside-vocab", body(prompt=[1, 999999]), 400, "999999"),
    Http("max-tokens-string", body(max_tokens="ten"), 400, "'max_tokens'"),
    Http("max-tokens-zero", body(max_tokens=0), 400, "'max_tokens'"),
    Http("max-tokens-past-context", body(max_tokens=100000), 400, "'max_tokens'"),
    Http("negative-temperature", body(temperature=-1), 400, "temperature"),
    Http("top-p-above-1", body(top_p=1.5), 400, "top_p"),
    Http("n-zero", body(n=0), 400, "'n'"),
    Http("stop-not-string", body(stop=5), 400, "'stop'"),
    Http("seed-string", body(seed="x"), 400, "'seed'"),
    Http("stream-string", body(stream="yes"), 400, "'stream'"),
    Http("logprobs-above-20", body(logprobs=21), 400, "'logprobs'"),
    Http("logit-bias-bad-key", body(logit_bias={"abc": 1}), 400, "'logit_bias'"),
    Http("unknown-field", body(frobnicate=1), 400, "frobnicate"),
    Http("suffix-refused", body(suffix="x"), 400, "suffix"),
    Http("bad-response-format", body(response_format={"type": "yaml"}), 400, "response_format"),
    Http("bad-regex", body(structured_outputs={"regex": "("}), 400, "structured_outputs"),
    Http("chat-messages-missing", json.dumps({"model": MODEL}).encode(), 400, "'messages'",
         path="/v1/chat/completions"),
    Http("chat-message-no-content", json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode(), 400,
         "messages[0]", path="/v1/chat/completions"),
    Http("chat-unknown-role", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(),
         400, "unknown role 'robot'", path="/v1/chat/completions"),
    Http("chat-tool-malformed", chat(tools=[{"type": "function"}]), 400, "'tools[0]'",
         path="/v1/chat/completions"),
    Http("chat-image-part", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
         400, "'messages[0].content[0].type': content parts of type 'image_url' are not supported",
         path="/v1/chat/completions"),
    Http("get-on-post-route", None, 405, "method GET not allowed", method="GET"),
    Http("unknown-route", body(), 404, "no route POST /v1/nothing", path="/v1/nothing"),
]


@dataclass(frozen=True)
class Cli:
    """`metrale ARGV` (MODEL and TMP filled in) exits 2 with one stderr line holding `needle`."""
    name: str
    argv: tuple[str, ...]
    needle: str


GEN = ("generate", "--model", "MODEL", "--prompt", "hi")
SERVE = ("serve", "--model", "MODEL")
CLI = [
    Cli("max-waiting-zero", (*SERVE, "--max-waiting", "0"), "argument --max-waiting: 0 must be at least 1"),
    Cli("max-waiting-not-int", (*SERVE, "--max-waiting", "many"), "--max-waiting: 'many' is not an integer"),
    Cli("request-timeout-negative", (*SERVE, "--request-timeout", "-1"), "--request-timeout: -1 must be"),
    Cli("drain-timeout-not-number", (*SERVE, "--drain-timeout", "soon"), "--drain-timeout: 'soon' is not a number"),
    Cli("port-out-of-range", (*SERVE, "--port", "70000"), "--port 70000 is not a TCP port"),
    Cli("unknown-flag", (*GEN, "--frobnicate"), "unrecognized arguments: --frobnicate"),
    Cli("bad-dtype", (*GEN, "--dtype", "float16"), "argument --dtype: invalid choice: 'float16'"),
    Cli("kv-cache-zero", (*GEN, "--kv-cache-tokens", "0"), "--kv-cache-tokens: 0 must be at least 1"),
    Cli("ep-zero", (*GEN, "--ep", "0"), "argument --ep: 0 must be at least 1"),
    Cli("eplb-negative", (*GEN, "--ep", "2", "--launcher", "mp", "--eplb-redundant-experts", "-1"),
        "--eplb-redundant-experts -1: must be at least 0"),
    Cli("eplb-not-placeable", (*GEN, "--ep", "2", "--launcher", "mp", "--eplb-redundant-experts", "1"),
        "do not split evenly over --ep 2"),
    Cli("eplb-without-ep", (*GEN, "--eplb-redundant-experts", "2"), "needs --ep 2 or more"),
    Cli("eplb-interval-without-copies", (*GEN, "--ep", "2", "--launcher", "mp", "--eplb-interval-steps", "8"),
        "--eplb-interval-steps 8: needs --eplb-redundant-experts"),
    Cli("eplb-interval-zero", (*GEN, "--ep", "2", "--launcher", "mp", "--eplb-redundant-experts", "2",
                               "--eplb-interval-steps", "0"), "--eplb-interval-steps 0: must be at least 1"),
    Cli("dp-attention-without-ep", (*GEN, "--dp-attention"), "--dp-attention splits sequences over EP ranks"),
    Cli("dp-attention-with-moe-a2a", (*GEN, "--ep", "2", "--launcher", "mp", "--dp-attention", "--moe-a2a",
                                      "alltoall"), "--dp-attention exchanges the routed experts' rows itself"),
    Cli("attention-tp-without-dp", (*GEN, "--ep", "2", "--launcher", "mp", "--attention-tp", "2"),
        "--attention-tp 2 splits attention inside --dp-attention's groups"),
    Cli("attention-tp-not-dividing", (*GEN, "--ep", "2", "--launcher", "mp", "--dp-attention", "--attention-tp", "4"),
        "--attention-tp 4: a power of two that divides --ep 2"),
    Cli("max-restarts-negative", (*GEN, "--max-restarts", "-1"), "--max-restarts -1 must be at least 0"),
    Cli("generate-max-tokens-zero", (*GEN, "--max-tokens", "0"), "max_tokens=0"),
    Cli("logit-bias-syntax", (*GEN, "--logit-bias", "5:1"), "--logit-bias '5:1': expected TOKEN_ID=BIAS"),
    Cli("bad-ladder", (*GEN, "--spec", "mtp", "--mtp-k-ladder", "oops"), "--mtp-k-ladder 'oops' is not a ladder"),
    Cli("width-cap-too-big", (*GEN, "--spec", "mtp", "--mtp-max-seqs", "999"), "mtp_max_seqs=999"),
    Cli("confidence-stop-above-1", (*GEN, "--spec", "mtp", "--draft-confidence-stop", "1.5"), "1.5"),
    Cli("tree-without-mtp", (*GEN, "--tree-shape", "1,2,2"), "needs --spec mtp"),
    Cli("chat-template-missing", (*SERVE, "--chat-template", "TMP/none.jinja"), "none.jinja: no such file"),
    Cli("tool-parser-unknown", (*SERVE, "--tool-call-parser", "xml"), "argument --tool-call-parser: invalid choice"),
    Cli("reasoning-parser-unknown", (*SERVE, "--reasoning-parser", "o1"), "argument --reasoning-parser: invalid choice"),
    Cli("prompts-file-missing", ("generate", "--model", "MODEL", "--prompts-file", "TMP/none.jsonl"),
        "none.jsonl' does not exist"),
]


@dataclass(frozen=True)
class Env:
    """A METRALE_* variable that does not parse: one warning line holding `needle`, the run goes on
    with the documented fallback (`error`: instead, the run stops with that one-line error)."""
    name: str
    env: dict
    needle: str
    error: bool = False


ENV = [
    Env("ladder", {"METRALE_MTP_K_LADDER": "2:1,oops"}, "METRALE_MTP_K_LADDER='2:1,oops' is not a ladder"),
    Env("shadow-topk", {"METRALE_MTP_SHADOW_TOPK": "lots"}, "METRALE_MTP_SHADOW_TOPK='lots' is not an integer"),
    Env("refeed-shift", {"METRALE_MTP_REFEED_SHIFT": "9", "METRALE_MTP_CATCHUP": "1"},
        "METRALE_MTP_REFEED_SHIFT='9' is outside -4..4; using 4"),
    Env("canonical-width", {"METRALE_CANONICAL_KEY_MIN_WIDTH": "-3"},
        "METRALE_CANONICAL_KEY_MIN_WIDTH='-3' is not a non-negative integer; using 8"),
    Env("ep-propose-yes", {"METRALE_NO_MTP_EP_PROPOSE": "yes"}, "METRALE_NO_MTP_EP_PROPOSE='yes' is not 1"),
    Env("catchup-true", {"METRALE_MTP_CATCHUP": "true"}, "METRALE_MTP_CATCHUP='true' is not 1"),
    Env("tree-shape", {"METRALE_TREE_SHAPE": "1,9"}, "METRALE_TREE_SHAPE: ", error=True),
]


@dataclass(frozen=True)
class Folder:
    """`metrale generate` (or serve) on the embedded model folder broken by `breaks` exits 2 with
    one stderr line holding `needle`."""
    name: str
    breaks: str
    needle: str
    command: str = "generate"


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((EMBEDDED / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    _rewrite(d, "config.json", json.dumps(cfg).encode())


def _edit_tensors(d: Path, change) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(EMBEDDED / "model.safetensors")
    change(tensors)
    (d / "model.safetensors").unlink()
    save_file(tensors, d / "model.safetensors")


def _rewrite(d: Path, name: str, data: bytes) -> None:
    """Replace the link `d/name` by a file of its own (never write through to the embedded model)."""
    (d / name).unlink(missing_ok=True)
    (d / name).write_bytes(data)


BREAKS = {
    "missing-folder": lambda d: shutil.rmtree(d),
    "no-config": lambda d: (d / "config.json").unlink(),
    "config-not-json": lambda d: _rewrite(d, "config.json", b"{oops"),
    "unknown-architecture": lambda d: _edit_config(d, architectures=["LlamaForCausalLM"], model_type="llama"),
    "config-missing-field": lambda d: _edit_config(d, hidden_size=None),
    "config-wrong-type": lambda d: _edit_config(d, num_attention_heads="four"),
    "config-negative": lambda d: _edit_config(d, num_hidden_layers=-1),
    "no-safetensors": lambda d: (d / "model.safetensors").unlink(),
    "corrupt-safetensors": lambda d: _rewrite(d, "model.safetensors", b"\x00garbage" * 100),
    "truncated-safetensors": lambda d: _rewrite(d, "model.safetensors",
                                                (EMBEDDED / "model.safetensors").read_bytes()[:1 << 20]),
    "wrong-tensor-shape": lambda d: _edit_tensors(d, lambda t: t.update(
        {"model.layers.1.mlp.experts.3.up_proj.weight": t["model.layers.1.mlp.experts.3.up_proj.weight"][:7, :5].contiguous()})),
    "missing-tensor": lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.2.self_attn.q_proj.weight")),
    "bad-tokenizer": lambda d: _rewrite(d, "tokenizer.json", b"{not a tokenizer"),
    "bad-tokenizer-config": lambda d: _rewrite(d, "tokenizer_config.json", b"{oops"),
    "template-does-not-compile": lambda d: _rewrite(d, "tokenizer_config.json", b'{"chat_template": "{% for %}"}'),
    "bad-metrale-toml": lambda d: _rewrite(d, "metrale.toml", b"[behavior\n"),
    "toml-width-cap-out-of-range": lambda d: _rewrite(d, "metrale.toml", b"[behavior]\nmtp_max_seqs = 999\n"),
    "toml-bad-ladder": lambda d: _rewrite(d, "metrale.toml", b'[behavior]\nmtp_k_ladder = "4:x"\n'),
}
FOLDERS = [
    Folder("missing-folder", "missing-folder", "does not exist"),
    Folder("no-config", "no-config", "config.json is missing"),
    Folder("config-not-json", "config-not-json", "config.json: not valid JSON"),
    Folder("unknown-architecture", "unknown-architecture", "architecture ['LlamaForCausalLM']"),
    Folder("config-missing-field", "config-missing-field", "missing field 'hidden_size'"),
    Folder("config-wrong-type", "config-wrong-type", "num_attention_heads='four' must be a whole number"),
    Folder("config-negative", "config-negative", "num_hidden_layers=-1 must be at least 1"),
    Folder("no-safetensors", "no-safetensors", "no *.safetensors file"),
    Folder("corrupt-safetensors", "corrupt-safetensors", "model.safetensors: not a readable safetensors file"),
    Folder("truncated-safetensors", "truncated-safetensors", "model.safetensors: not a readable safetensors file"),
    Folder("wrong-tensor-shape", "wrong-tensor-shape",
           "'model.layers.1.mlp.experts.3.up_proj.weight' has shape (7, 5), expected (256, 256)"),
    Folder("missing-tensor", "missing-tensor", "lacks tensor(s) for: layers.2.self_attn.q_proj.weight"),
    Folder("bad-tokenizer", "bad-tokenizer", "tokenizer.json: not a readable tokenizer"),
    Folder("bad-tokenizer-config", "bad-tokenizer-config", "tokenizer_config.json: not valid JSON", command="serve"),
    Folder("template-does-not-compile", "template-does-not-compile", "chat_template does not compile",
           command="serve"),
    Folder("bad-metrale-toml", "bad-metrale-toml", "metrale.toml: not valid TOML"),
    Folder("toml-width-cap-out-of-range", "toml-width-cap-out-of-range", "mtp_max_seqs=999"),
    Folder("toml-bad-ladder", "toml-bad-ladder", "mtp_k_ladder='4:x' is not a ladder"),
]


def test_the_table_is_long_and_distinct():
    names = [c.name for table in (HTTP, CLI, ENV, FOLDERS) for c in table]
    assert len(names) == len(set(names)) and len(names) >= 30
    assert {f.breaks for f in FOLDERS} == set(BREAKS)


# --- HTTP -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    proc, base = start_server(EMBEDDED, "--enforce-eager", "--max-num-seqs", "4")
    yield base
    stop_server(proc)


@pytest.mark.parametrize("case", HTTP, ids=[c.name for c in HTTP])
def test_http(server, case):
    status, raw = http(case.method, server + case.path, case.data, case.headers)
    assert status == case.status, raw[:300]
    err = json.loads(raw)["error"]
    assert case.needle in err["message"] and "\n" not in err["message"], err
    assert err["type"]
    assert http("GET", server + "/health")[0] == 200


# --- CLI, METRALE_* variables and model folders (in-process: `launch.cli.main`) ----------------
@pytest.fixture
def fresh(monkeypatch):
    """A process as the CLI finds it: nothing published, every METRALE_* knob read anew."""
    from speculative import draft_stop, knobs, ladder
    monkeypatch.setattr(ladder, "_published_ladder", None)
    monkeypatch.setattr(ladder, "_published_max_seqs", None)
    monkeypatch.setattr(draft_stop, "_published", None)
    for name in list(vars(knobs)) + ["_env_ladder"]:
        reader = getattr(knobs, name, None) or getattr(ladder, name, None)
        if hasattr(reader, "cache_clear"):
            reader.cache_clear()
    yield
    for name in list(vars(knobs)) + ["_env_ladder"]:
        reader = getattr(knobs, name, None) or getattr(ladder, name, None)
        if hasattr(reader, "cache_clear"):
            reader.cache_clear()


def run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    """`metrale ARGV` in this process: its exit status and its stderr lines."""
    from launch.cli import main
    try:
        code = main(argv)
    except SystemExit as exc:   # argparse
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


def one_line_error(code: int, lines: list[str], needle: str, command: str) -> None:
    """Exit status 2 and one line, `metrale COMMAND: error: ...` (`metrale: error: ...` when
    argparse could not tell the command's flags apart)."""
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith((f"metrale {command}: error: ", "metrale: error: ")) and needle in lines[0], lines


@pytest.mark.parametrize("case", CLI, ids=[c.name for c in CLI])
def test_cli(case, fresh, capsys, tmp_path):
    argv = [a.replace("MODEL", str(EMBEDDED)).replace("TMP", str(tmp_path)) for a in case.argv]
    code, lines = run_main(argv, capsys)
    one_line_error(code, lines, case.needle, argv[0])


@pytest.mark.parametrize("case", ENV, ids=[c.name for c in ENV])
def test_env(case, fresh, monkeypatch, capsys, caplog):
    from speculative.ladder import mtp_catchup_enabled, mtp_refeed_accepted_enabled
    from speculative.settings import resolve_spec_settings
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    if case.error:
        code, lines = run_main([*GEN[:2], str(EMBEDDED), *GEN[3:], "--spec", "mtp"], capsys)
        one_line_error(code, lines, case.needle, "generate")
        return
    with caplog.at_level(logging.WARNING, logger="metrale.knobs"):
        resolve_spec_settings(method="mtp", num_drafts=3, width_cap=1)
        mtp_catchup_enabled()
        mtp_refeed_accepted_enabled()
    warned = [r.getMessage() for r in caplog.records if r.name == "metrale.knobs"]
    assert len(warned) == 1 and case.needle in warned[0] and "\n" not in warned[0], warned


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """name -> the embedded model folder broken that way (unchanged files are links)."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for name, breaks in BREAKS.items():
        d = root / name
        d.mkdir()
        for f in EMBEDDED.iterdir():
            (d / f.name).symlink_to(f)
        breaks(d)
        out[name] = d
    return out


@pytest.mark.parametrize("case", FOLDERS, ids=[c.name for c in FOLDERS])
def test_model_folder(case, broken, fresh, capsys):
    argv = [case.command, "--model", str(broken[case.breaks]), "--enforce-eager"]
    if case.command == "generate":
        argv += ["--prompt", "hi", "--max-tokens", "1"]
    code, lines = run_main(argv, capsys)
    one_line_error(code, lines, case.needle, case.command)


def test_a_bad_model_folder_is_one_line_from_the_real_command(broken):
    """The in-process table above, once through a real process: no traceback, one line, status 2."""
    res = subprocess.run(metrale_cmd("generate", "--model", str(broken["truncated-safetensors"]), "--prompt", "hi"),
                         capture_output=True, text=True, env=run_env(), timeout=120, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    [line] = res.stderr.strip().splitlines()
    assert "not a readable safetensors file" in line
