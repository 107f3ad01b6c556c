"""Sampling: one per-row processing of the target's logits, then greedy or a draw keyed by (seed, position).

Every logits row, whether a plain decode row, a chain verify row (exact or rejection) or a tree
verify row, goes through `process_logits` with the tokens before the one it draws (`History`): the
committed output plus the drafts on the row's path, which are exactly the tokens plain decoding
would have committed by then whenever the row's token is used. So penalties, bias and min_tokens
give the same tokens with speculation on or off (docs/design.md §5.2).

Processing order (vLLM's): the grammar mask of a structured output (the tokens it allows after the
row's history, `runtime.sample.grammar`), logit_bias, the min_tokens mask on stop ids, repetition penalty (prompt
and output tokens: positive logits divided, negative multiplied), frequency and presence
penalties (output tokens), then temperature for sampled requests. Logprobs are log_softmax of
that; sampling then applies min_p, top-k and top-p. The uniforms for the token at absolute
position p of a request with seed s come from (s, p) alone (a counter-based splitmix64 stream,
computed on the logits' device for every row at once: the same numbers on the CPU and a GPU), so
a request's tokens never depend on what else is in the batch, on batch width, or on whether
speculation verified them.

Shapes: N rows, V vocab.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from runtime.sample.grammar import StructuredOutput

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20


class SamplingParamError(ValueError):
    """A sampling parameter out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0                 # EOS is masked until this many output tokens
    seed: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | tuple[str, ...] | None = None
    presence_penalty: float = 0.0       # subtracted once from every token in the output
    frequency_penalty: float = 0.0      # subtracted per occurrence in the output
    repetition_penalty: float = 1.0     # divides positive / multiplies negative logits of prompt+output tokens
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None   # token id -> bias
    logprobs: int | None = None         # keep each output token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the first gets None)
    structured: StructuredOutput | None = None  # the grammar the output must match

    def __post_init__(self) -> None:
        def bad(field: str, message: str) -> SamplingParamError:
            return SamplingParamError(field, f"{field}={getattr(self, field)!r} {message}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer of at least 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in 0..max_tokens ({self.max_tokens})")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be a non-negative integer (0 = off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer")
        for field in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, field) <= 2.0:
                raise bad(field, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "must be a positive number (1 = off)")
        for field in ("logprobs", "prompt_logprobs"):
            n = getattr(self, field)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise bad(field, f"must be None or an integer in 0..{MAX_LOGPROBS}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop and any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if self.logit_bias is not None:
            bias = tuple(sorted((t, float(b)) for t, b in dict(self.logit_bias).items()))
            if any(not _is_int(t) or t < 0 or not -100.0 <= b <= 100.0 for t, b in bias):
                raise bad("logit_bias", "must map token ids (>= 0) to biases in [-100, 100]")
            object.__setattr__(self, "logit_bias", bias or None)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise bad("structured", "must be a runtime.sample.grammar.StructuredOutput")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether a row's processing depends on the tokens before it (penalties, min_tokens, a grammar)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or self.min_tokens > 0 or self.structured is not None)

    @property
    def is_plain(self) -> bool:
        """No processing beyond temperature, top-k and top-p, and no logprobs kept."""
        return (not self.needs_history and self.logit_bias is None and self.min_p == 0.0
                and self.logprobs is None)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class History:
    """The tokens before the one a row draws: the sequence's committed tokens, then the drafts on
    the row's path (chain row r: drafts 0..r-1; tree row: its ancestors and itself, below the root).
    `stop_ids` are masked while the output is shorter than min_tokens; `allowed` is the grammar's
    mask after those tokens (None: no grammar, or a path the grammar refuses)."""
    token_ids: Sequence[int]            # prompt + committed output (read, never copied or changed)
    prompt_len: int
    path: Sequence[int] = ()
    stop_ids: tuple[int, ...] = ()
    allowed: torch.Tensor | None = None     # bool [V]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len + len(self.path)

    def output_ids(self) -> list[int]:
        return [*self.token_ids[self.prompt_len:], *self.path]


NO_HISTORY = History((), 0)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One token's log-probability and the `num_top` most likely tokens, best first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RowSpec:
    """What one logits row is sampled with: the request, the position of the token it draws, and
    the tokens before that one."""
    params: SamplingParams
    seed: int
    position: int
    history: History = NO_HISTORY


@dataclass(frozen=True, slots=True)
class Sampled:
    token: int
    logprobs: TokenLogprobs | None = None   # when the request keeps logprobs


def process_logits(logits: torch.Tensor, params: SamplingParams, history: History = NO_HISTORY) -> torch.Tensor:
    """One row's logits [V] -> processed logits [V] (float64): the grammar mask, logit_bias, the min_tokens mask,
    repetition/frequency/presence penalties over `history`, then temperature (sampled requests).
    The arg-max of the result is the greedy token; its log_softmax gives the logprobs."""
    # Its own copy when changed in place (float64 logits would otherwise be the caller's tensor).
    out = logits.to(torch.float64, copy=params.logit_bias is not None or params.needs_history)
    vocab = out.shape[-1]
    if history.allowed is not None:
        out.masked_fill_(~history.allowed, float("-inf"))
    if params.logit_bias is not None:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=out.device)
        out[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64, device=out.device)
    if params.min_tokens > 0 and history.num_output < params.min_tokens and history.stop_ids:
        out[list(history.stop_ids)] = float("-inf")
    if params.needs_history:
        output = torch.tensor(history.output_ids(), dtype=torch.long, device=out.device)
        counts = torch.bincount(output, minlength=vocab).to(torch.float64)    # [V]
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = list(history.token_ids[:history.prompt_len])
            seen[torch.tensor(prompt, dtype=torch.long, device=out.device)] = True
            scale = torch.where(out > 0, 1.0 / params.repetition_penalty, params.repetition_penalty)
            out = torch.where(seen, out * scale, out)
        if params.frequency_penalty != 0.0:
            out -= params.frequency_penalty * counts
        if params.presence_penalty != 0.0:
            out -= params.presence_penalty * (counts > 0).to(torch.float64)
    if not params.is_greedy:
        out = out / params.temperature
    return out


def sampling_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed logits [V] -> the distribution the request samples from [V] (float64): min_p
    (drop tokens below min_p times the top probability), then top-k, then top-p (the smallest set
    of highest-probability tokens whose mass reaches top_p). Greedy requests get a one-hot at the
    arg-max."""
    if params.is_greedy:
        return torch.zeros_like(processed).scatter_(0, torch.argmax(processed).view(1), 1.0)   # no host read
    logits = processed
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop = before >= params.top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def target_probs(logits: torch.Tensor, params: SamplingParams, history: History = NO_HISTORY) -> torch.Tensor:
    """One row's logits [V] -> the distribution the request samples from [V] (float64)."""
    return sampling_probs(process_logits(logits, params, history), params)


def token_logprobs(processed: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """The logprob of `token` under processed logits [V] and the `num_top` best alternatives."""
    logprobs = torch.log_softmax(processed, dim=-1)
    top = ()
    if num_top > 0:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token, float(logprobs[token]), top)


def prompt_token_logprobs(logits: torch.Tensor, tokens: Sequence[int], params: SamplingParams,
                          num_top: int) -> list[TokenLogprobs]:
    """logits [N, V] of prefill rows -> the logprob of `tokens[i]` (the prompt token row i
    predicts) and the top alternatives, under temperature only (1 for greedy requests): penalties,
    bias and min_tokens shape what is generated, not how the prompt is scored."""
    scaled = logits.to(torch.float64)
    if not params.is_greedy:
        scaled = scaled / params.temperature
    return [token_logprobs(scaled[i], t, num_top) for i, t in enumerate(tokens)]


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` (n > 1): choice 0 keeps the seed, so
    it equals the n=1 request; the others get distinct, reproducible seeds."""
    return seed if index == 0 else splitmix64(splitmix64(seed) ^ splitmix64(index)) & ((1 << 63) - 1)


def position_key(seed: int, position: int) -> int:
    """The 63-bit key of the token at absolute `position` of a request seeded `seed`."""
    return splitmix64(splitmix64(seed) ^ position) & ((1 << 63) - 1)


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def key_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys [N] int64 -> [N, n] float64 uniforms in [0, 1): the first n outputs of splitmix64
    seeded with each key, computed on the keys' device with wrapping int64 arithmetic (no
    generator, no host read: one op sequence for every row at once; the same numbers on every
    device)."""
    i = torch.arange(1, n + 1, dtype=torch.long, device=keys.device)
    x = keys[:, None] + i[None, :] * _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    x = x ^ _shr(x, 31)
    return _shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


def position_uniforms(seed: int, position: int, n: int, device: torch.device | str) -> torch.Tensor:
    """[n] float64 uniforms on `device` for the token at absolute `position` of a request seeded `seed`."""
    return key_uniforms(torch.tensor([position_key(seed, position)], dtype=torch.long, device=device), n)[0]


def draw_rows(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of `probs` [N, V] with each row's key [N] (exponential race:
    argmax of p_i / E_i, E_i ~ Exp(1), is a draw from p) -> [N] on the device, no host read."""
    u = key_uniforms(keys, probs.shape[-1])
    return torch.argmax(probs.to(torch.float64) / -torch.log1p(-u), dim=-1)


def draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """Sample one token from `probs` [V] with the (seed, position) key."""
    keys = torch.tensor([position_key(seed, position)], dtype=torch.long, device=probs.device)
    return int(draw_rows(probs[None], keys)[0])


def sample_row(logits: torch.Tensor, row: RowSpec) -> Sampled:
    """One row's logits [V] -> its token (and logprobs when the request keeps them)."""
    params = row.params
    processed = process_logits(logits, params, row.history)
    if params.is_greedy:
        token = int(torch.argmax(processed))
    else:
        token = draw(sampling_probs(processed, params), row.seed, row.position)
    lp = token_logprobs(processed, token, params.logprobs) if params.logprobs is not None else None
    return Sampled(token, lp)


def sample_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token a request without history emits at `position` given that position's logits [V]."""
    return sample_row(logits, RowSpec(params, seed, position)).token


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSpec]) -> list[Sampled]:
    """logits [N, V] -> one `Sampled` per row, as `sample_row` samples each: plain greedy rows share
    one arg-max, the other rows' tokens stay on the device (sampled rows drawn together by their
    keys) until one host read for the whole batch; logprobs are read for the rows that ask."""
    tokens = torch.argmax(logits, dim=-1)                                   # [N]
    probs, keys, drawn, kept = [], [], [], {}
    for i, r in enumerate(rows):
        params = r.params
        if params.is_greedy and params.is_plain:
            continue
        processed = process_logits(logits[i], params, r.history)
        if params.is_greedy:
            tokens[i] = torch.argmax(processed)
        else:
            probs.append(sampling_probs(processed, params))
            keys.append(position_key(r.seed, r.position))
            drawn.append(i)
        if params.logprobs is not None:
            kept[i] = processed
    if drawn:
        picks = draw_rows(torch.stack(probs), torch.tensor(keys, dtype=torch.long, device=logits.device))
        tokens[torch.tensor(drawn, device=logits.device)] = picks
    host = tokens.tolist()
    return [Sampled(t, token_logprobs(kept[i], t, rows[i].params.logprobs) if i in kept else None)
            for i, t in enumerate(host)]
