"""Offline generation: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from runtime.engine import Engine, EngineConfig
from runtime.model_runner import ModelRunner
from runtime.sampler import SamplingParams
from runtime.sequence import RequestOutput
from runtime.tokenizer import Tokenizer
from runtime.weights import load_model

Prompt = str | list[int]
SPEC_METHODS = ("none", "mtp", "ngram")


def make_proposer(spec: str, model, runner: ModelRunner):
    """The drafter for `spec`: the checkpoint's MTP layer, prompt lookup, or none."""
    if spec == "mtp":
        from speculative.mtp import MTPProposer
        return MTPProposer(model, runner.cache)
    if spec == "ngram":
        from speculative.ngram import NgramProposer
        return NgramProposer()
    return None


class LLM:
    """Loads a checkpoint folder and generates for batches of prompts (text or token ids)."""

    def __init__(self, model: str | Path, dtype: str = "float32", *, kv_cache_tokens: int = 32768,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, spec: str = "none",
                 num_drafts: int = 3) -> None:
        model_dir = Path(model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {str(model_dir)!r} does not exist")
        self.model_dir = model_dir
        self.model = load_model(model_dir, dtype)
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        if spec not in SPEC_METHODS:
            raise ValueError(f"spec={spec!r} is not a speculation method (expected one of {', '.join(SPEC_METHODS)})")
        config = EngineConfig(kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              num_drafts=num_drafts if spec != "none" else 0)
        runner = ModelRunner(self.model, kv_cache_tokens=config.kv_cache_tokens, block_size=config.block_size)
        self.engine = Engine(runner, self.tokenizer, config, make_proposer(spec, self.model, runner))

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer.json: give prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Serve all prompts together as one batch; outputs come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        per = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} SamplingParams for {len(prompts)} prompts")
        seqs = []
        try:
            for prompt, p in zip(prompts, per):
                seqs.append(self.engine.add_request(self.encode(prompt), p))
        except Exception:
            for s in seqs:
                self.engine.abort(s)
            raise
        self.engine.run_to_completion()
        return [RequestOutput.of(i, s) for i, s in enumerate(seqs)]

    def shutdown(self) -> None:
        """Release the model and cache (the EP launcher also ends its workers here)."""
        self.engine = None
        self.model = None
        torch.set_grad_enabled(True)
