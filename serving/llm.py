"""Offline generation: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from engine.engine import Engine, EngineConfig
from ep.comm import Communicator
from runtime.platform.device import resolve_device
from runtime.sample.sampler import SamplingParams
from engine.sequence import RequestOutput, Sequence
from engine.tokenizer import Tokenizer
from serving.deployment import DEFAULT_MAX_RESTARTS, Deployment, DeploymentConfig, Launcher
from serving.settings import Settings
from speculative.settings import SpecSettings, resolve_spec_settings

Prompt = str | list[int]


class LLM:
    """Loads a checkpoint folder and generates for batches of prompts (text or token ids)."""

    def __init__(self, model: str | Path, dtype: str = "float32", *, kv_cache_tokens: int = 32768,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, spec: str = "none",
                 num_drafts: int = 3, spec_verify: str = "exact", draft_policy: str | None = None,
                 mtp_k_ladder: str | None = None, mtp_max_seqs: int | None = None,
                 draft_confidence_stop: float | None = None, tree_shape: str | None = None,
                 spec_settings: SpecSettings | None = None, ep: int = 1, moe_a2a: str = "auto",
                 ep_timeout_s: float = 60.0, launcher: Launcher | None = None,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, comm: Communicator | None = None,
                 enforce_eager: bool = False, batch_invariant: bool | None = None,
                 prefix_cache: bool = True, warm_standby: bool = True, device: str = "auto",
                 gpu_memory_utilization: float | None = None, static_steps: bool | None = None,
                 kv_block_size: int = 16, eplb_redundant_experts: int | None = None,
                 eplb_interval_steps: int | None = None, dp_attention: bool = False,
                 attention_tp: int = 1, two_batch_overlap: bool = False) -> None:
        """Speculation: `spec` (none, mtp, ngram) with at most `num_drafts` drafts per step, a
        depth policy (`draft_policy` fixed/ladder/auto, or `mtp_k_ladder` text or "auto"), a
        width cap `mtp_max_seqs`, a confidence stop, a draft-tree shape ("1,2,2"); resolved once
        (argument > published > environment > the model folder's metrale.toml > default), or
        given whole as `spec_settings`.

        `ep` > 1 starts ep - 1 worker ranks with `launcher` (`launch.mp.MPGroup`, or a
        `launch.ray_group.RayGroup` factory) and supervises them: a dead rank restarts the group
        up to `max_restarts` times. `comm`, an already joined communicator of rank 0 (torchrun),
        replaces the launcher (no restarts). `warm_standby`: the launcher keeps a spare process per
        worker rank with its shard loaded, so a restart needs no cold start (when restarts are allowed).

        The target step is compiled with `torch.compile` (inductor) unless `enforce_eager`, on
        every rank of an EP group alike (its collectives are opaque ops of the graph); float64
        (the reference mode) runs eager.

        `batch_invariant`: every operation whose per-row result could depend on the rows beside
        it runs a batch-invariant kernel (`runtime.ops.batch_invariant`), so a request's tokens do not
        depend on what else is in its steps: its width, speculation, other requests. None (the
        default) turns it on for float64 only. Compiled and eager steps are each invariant, but
        round otherwise than each other: EP 2 gives EP 1's tokens when both compile (the default)
        or both run eager (`enforce_eager`).

        `prefix_cache` (on by default): a prompt that starts with full KV blocks an earlier request
        computed attaches them instead of computing them again (engine.prefix_cache).

        `device`: auto (CUDA when present), cpu, cuda or cuda:N; weights, cache, step tensors
        and the drafter live there, and each EP rank takes its own local GPU.
        `gpu_memory_utilization` (CUDA only, as vLLM's): the KV cache takes what is left of this
        share of the GPU's memory after the weights, instead of `kv_cache_tokens`.
        `static_steps`: decode and verify steps padded to row buckets (runtime.executor.static_step) and,
        on CUDA unless `enforce_eager`, captured as CUDA graphs; None: on for CUDA only.
        `kv_block_size`: tokens per KV block (the prefix cache's unit; vLLM's `block_size`), 16 by
        default; other sizes are served by one rank (an EP group keeps 16).
        `eplb_redundant_experts` (EP only): EPLB with that many redundant expert slots and
        per-expert load counters (ep.placement); `eplb_interval_steps`: re-place the experts from
        the counted loads every that many forwards. `dp_attention` (EP only, docs/design.md §4.3):
        each rank runs attention, dense layers and the LM head over its own sequences and the
        routed experts exchange rows all-to-all; the padded decode exchange takes
        ceil(max_num_seqs / ep) sequences of 1 + the drafts a verify checks a rank. Its ranks
        keep each sequence's keys and values on one rank, so the prefix cache is off.
        `attention_tp` K (with `dp_attention`, K a power of two dividing `ep`): groups of K ranks
        share their sequences and split attention heads among them, tensor-parallel.
        `two_batch_overlap` (with `dp_attention`, eager steps): each rank's rows run as two
        micro-batches, one's expert exchange in flight while the other computes (ep.overlap)."""
        model_dir = Path(model)
        resolved = resolve_device(device) if comm is None else comm.device
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {str(model_dir)!r} does not exist")
        self.spec = spec_settings or resolve_spec_settings(
            method=spec, num_drafts=num_drafts, depth_policy=draft_policy, k_ladder=mtp_k_ladder,
            width_cap=mtp_max_seqs, confidence_stop=draft_confidence_stop, tree_shape=tree_shape,
            verify=spec_verify, model_dir=model_dir, dtype=dtype)
        self.model_dir = model_dir
        config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              prefix_cache=prefix_cache and not dp_attention)
        self.deployment = Deployment(
            DeploymentConfig(model_dir=model_dir, dtype=dtype, ep=ep if comm is None else comm.world_size,
                             moe_a2a=moe_a2a, kv_cache_tokens=kv_cache_tokens, ep_timeout_s=ep_timeout_s,
                             max_restarts=max_restarts, enforce_eager=enforce_eager,
                             batch_invariant=batch_invariant,
                             warm_standby=warm_standby, device=str(resolved),
                             gpu_memory_utilization=gpu_memory_utilization, static_steps=static_steps,
                             kv_block_size=kv_block_size, eplb_redundant_experts=eplb_redundant_experts,
                             eplb_interval_steps=eplb_interval_steps, max_num_seqs=max_num_seqs,
                             dp_attention=dp_attention, attention_tp=attention_tp,
                             two_batch_overlap=two_batch_overlap),
            self.spec, launcher, comm)
        runner = self.deployment.runner
        # Every setting this LLM runs by, resolved once (serving.settings).
        self.settings = Settings(deployment=self.deployment.config, engine=config, spec=self.spec,
                                 step=getattr(runner, "local", runner).settings)
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        self.engine: Engine | None = Engine(self.deployment.runner, self.tokenizer, config, self.spec,
                                            self.deployment.proposer)

    @property
    def rank_info(self) -> list[dict]:
        return self.deployment.rank_info

    @property
    def rank_weight_bytes(self) -> list[int]:
        return self.deployment.rank_weight_bytes

    def expert_stats(self) -> dict:
        """EPLB's counters (`--eplb-redundant-experts`): `loads[layer][expert]`, the tokens routed
        to each expert of each MoE layer since start (model order), the live re-placements and the
        expert weight bytes rank 0 received in them; {} without EPLB."""
        runner = self.deployment.runner
        if not getattr(runner, "eplb", False):
            return {}
        return {"loads": runner.expert_loads(), "placements": runner.placements,
                "bytes_received": runner.eplb_bytes_received}

    @property
    def model(self):
        return self.deployment.runner.model

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
        seqs: list[Sequence] = []
        try:
            for prompt, p in zip(prompts, per):
                seqs.append(self.engine.add_request(self.encode(prompt), p))
        except Exception:
            for s in seqs:
                self.engine.abort(s)
            raise
        try:
            with torch.inference_mode():
                while self.engine.has_unfinished():
                    self.deployment.step(self.engine)
        except BaseException:
            self.shutdown(graceful=False)  # an EP error or Ctrl-C leaves the group unusable
            raise
        return [RequestOutput.of(i, s) for i, s in enumerate(seqs)]

    def step(self):
        """One supervised step (the benchmark's closed loop drives the engine through this)."""
        with torch.inference_mode():
            return self.deployment.step(self.engine)

    def shutdown(self, graceful: bool = True) -> None:
        """End the EP workers (if any) and release the model and cache."""
        if self.engine is None:
            return
        self.deployment.shutdown(graceful)
        self.engine = None
