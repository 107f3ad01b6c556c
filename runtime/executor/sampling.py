"""The sampler backend a runner chooses once (docs/design.md §5.2): the reference per-row path of
runtime.sample.sampler, or the Triton sampling kernel (runtime.ops.kernels.sampling) that draws
every row of a step in one launch and leaves the tokens on the device.

Both give a row the same token for the same (seed, position) key: the kernel draws from the same
splitmix64 uniforms with the same rules (see the kernel's docstring for where float rounding at a
boundary may decide otherwise). Rows whose processing goes beyond temperature (penalties,
logit_bias, min_tokens, a grammar) are processed by `process_logits` first, as the reference does,
and enter the kernel in float64 at temperature 1.

Shapes: N rows, V vocab.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.ops import kernels
from runtime.sample.sampler import RowSpec, Sampled, position_key, process_logits, sample_rows, token_logprobs


@dataclass(frozen=True, slots=True)
class RowDraws:
    """A step's draws on the device, one entry per row: the token, its logprob under the row's
    processed logits, and the probability of the row's draft under its sampling distribution."""
    tokens: torch.Tensor        # [N] int64
    logprobs: torch.Tensor      # [N] float64
    draft_probs: torch.Tensor   # [N] float64 (0 for rows without a draft)


class ReferenceSampler:
    """`runtime.sample.sampler.sample_rows`: each row processed and drawn with torch ops."""
    name = "torch"
    on_device = False

    def sample_rows(self, logits: torch.Tensor, rows: Sequence[RowSpec]) -> list[Sampled]:
        return sample_rows(logits, rows)


def _needs_processing(row: RowSpec) -> bool:
    """Whether a row's logits change before temperature (`process_logits`' grammar, bias, min_tokens, penalties)."""
    return row.params.needs_history or row.params.logit_bias is not None or row.history.allowed is not None


class KernelSampler:
    """The Triton sampling kernel: one launch per step, the tokens read once for the whole batch."""
    name = "triton"
    on_device = True

    def draws(self, logits: torch.Tensor, rows: Sequence[RowSpec], drafts: Sequence[int] | None = None) -> RowDraws:
        """logits [N, V] -> every row's draw on the device; `drafts` (one per row, -1 for none)
        make a row draw from its distribution without its draft (rejection's residual)."""
        from runtime.ops.kernels.sampling import sample_logits
        n = logits.shape[0]
        if n != len(rows) or (drafts is not None and len(drafts) != n):
            raise ValueError(f"{n} logits rows for {len(rows)} row specs"
                             + ("" if drafts is None else f" and {len(drafts)} drafts"))
        dev = logits.device
        processed = [i for i, r in enumerate(rows) if _needs_processing(r)]
        x = logits
        if processed:
            x = logits.to(torch.float64, copy=True)
            x[processed] = torch.stack([process_logits(logits[i], rows[i].params, rows[i].history) for i in processed])
        done = set(processed)
        temps = [(1.0 if i in done else r.params.temperature) if not r.params.is_greedy else 0.0
                 for i, r in enumerate(rows)]
        floats = torch.tensor([temps, [r.params.top_p for r in rows], [r.params.min_p for r in rows]],
                              dtype=torch.float64).to(dev)
        ints = torch.tensor([[r.params.top_k for r in rows], [position_key(r.seed, r.position) for r in rows],
                             list(drafts) if drafts is not None else [-1] * n], dtype=torch.long).to(dev)
        tokens, lp, pd = sample_logits(x, floats[0], ints[0], floats[1], floats[2], ints[1], ints[2])
        return RowDraws(tokens, lp, pd)

    def sample_rows(self, logits: torch.Tensor, rows: Sequence[RowSpec]) -> list[Sampled]:
        """As `runtime.sample.sampler.sample_rows`: one host read for the batch, then the logprobs
        of the rows that keep them."""
        host = self.draws(logits, rows).tokens.tolist()
        out = []
        for i, (t, r) in enumerate(zip(host, rows)):
            n = r.params.logprobs
            lp = None if n is None else token_logprobs(process_logits(logits[i], r.params, r.history), t, n)
            out.append(Sampled(t, lp))
        return out


REFERENCE = ReferenceSampler()
KERNEL = KernelSampler()


def choose_sampler(device: torch.device, kernel: bool | None = None) -> ReferenceSampler | KernelSampler:
    """The sampler backend of a runner on `device`, chosen once: the Triton kernel where `kernel`
    (None: on CUDA where triton is installed), else the reference path."""
    if kernel is None:
        kernel = device.type == "cuda" and kernels.available("cuda")
    if kernel and not kernels.available(device.type):
        raise ValueError(f"the Triton sampling kernel cannot run on {device} here (triton missing, "
                         "or TRITON_INTERPRET not 1 for CPU tensors)")
    return KERNEL if kernel else REFERENCE
