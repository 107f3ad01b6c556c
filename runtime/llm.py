"""Offline generation: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path


from runtime.engine import Engine, EngineConfig
from runtime.model_runner import ModelRunner
from runtime.sampler import SamplingParams
from runtime.sequence import RequestOutput
from runtime.tokenizer import Tokenizer
from runtime.weights import load_model
from speculative.knobs import tree_shape_env
from speculative.tree_shape import TreeShape

Prompt = str | list[int]


def local_rank_info(rank: int) -> dict:
    import os
    import socket
    return {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
SPEC_METHODS = ("none", "mtp", "ngram")


def make_proposer(spec: str, model, runner, confidence_stop: float | None = None):
    """The drafter for `spec`: the checkpoint's MTP layer (sharded across EP ranks when the
    runner drives a group), prompt lookup, or none."""
    if spec == "mtp":
        from speculative.mtp import MTPProposer
        if isinstance(runner, ModelRunner):
            return MTPProposer(model, runner.cache, confidence_stop)
        from ep.shard import ShardedMTPProposer
        if model.mtp is None:
            raise ValueError("this checkpoint has no MTP layer: MTP speculation needs one")
        return ShardedMTPProposer(runner, confidence_stop)
    if spec == "ngram":
        from speculative.ngram import NgramProposer
        return NgramProposer()
    return None


def resolve_tree_shape(text: str | None, spec: str) -> TreeShape | None:
    """The draft-tree shape: `text`, else METRALE_TREE_SHAPE when speculating with MTP; refused
    (ValueError) when it does not parse or when the drafter is not MTP (hedges need its distribution)."""
    if text is None:
        env = tree_shape_env()
        if env is None or spec != "mtp":
            return None
        try:
            return TreeShape.parse(env)
        except ValueError as exc:
            raise ValueError(f"METRALE_TREE_SHAPE: {exc}") from None
    if spec != "mtp":
        raise ValueError(f"a tree shape ({text}) needs spec='mtp': hedges are the MTP drafter's next-best tokens")
    return TreeShape.parse(text)


class LLM:
    """Loads a checkpoint folder and generates for batches of prompts (text or token ids)."""

    def __init__(self, model: str | Path, dtype: str = "float32", *, kv_cache_tokens: int = 32768,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, spec: str = "none",
                 num_drafts: int = 3, spec_verify: str = "exact", draft_policy: str = "ladder",
                 mtp_max_seqs: int | None = None, draft_confidence_stop: float | None = None, ep: int = 1, moe_a2a: str = "alltoall", ep_timeout_s: float = 60.0,
                 comm=None, tree_shape: str | None = None) -> None:
        """`ep` > 1 spawns ep - 1 workers (the mp launcher) unless `comm`, an already joined
        communicator of rank 0 (torchrun), is given. `tree_shape` ("1,2,2") drafts trees with the
        MTP drafter; None takes METRALE_TREE_SHAPE when spec is mtp."""
        model_dir = Path(model)
        tree = resolve_tree_shape(tree_shape, spec)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {str(model_dir)!r} does not exist")
        self.model_dir = model_dir
        self.group = None
        self.rank_weight_bytes: list[int] = []
        self.rank_info: list[dict] = [local_rank_info(0)]
        if ep > 1 or comm is not None:
            runner = self._start_ep(model_dir, dtype, ep, moe_a2a, ep_timeout_s, kv_cache_tokens, comm)
        else:
            runner = ModelRunner(load_model(model_dir, dtype), kv_cache_tokens=kv_cache_tokens)
        self.model = runner.model
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        if spec not in SPEC_METHODS:
            raise ValueError(f"spec={spec!r} is not a speculation method (expected one of {', '.join(SPEC_METHODS)})")
        config = EngineConfig(kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              num_drafts=num_drafts if spec != "none" else 0, spec_verify=spec_verify,
                              draft_policy=draft_policy, mtp_max_seqs=mtp_max_seqs, tree_shape=tree)
        try:
            proposer = make_proposer(spec, self.model, runner, draft_confidence_stop)
        except BaseException:
            if not isinstance(runner, ModelRunner):
                runner.shutdown()
            self.engine = None
            self._stop_group()
            raise
        self.engine = Engine(runner, self.tokenizer, config, proposer)

    def _start_ep(self, model_dir: Path, dtype: str, ep: int, moe_a2a: str, timeout_s: float,
                  kv_cache_tokens: int, comm):
        from ep.shard import DriverRunner, driver_handshake, gather_rank_info, gather_weight_bytes, load_shard
        if comm is None:
            from launch.mp import GroupConfig, MPGroup
            self.group = MPGroup(GroupConfig(model_dir=str(model_dir), dtype=dtype, ep=ep, moe_a2a=moe_a2a,
                                             kv_cache_tokens=kv_cache_tokens, timeout_s=timeout_s))
            comm = self.group.comm
        self.comm = comm
        try:
            driver_handshake(comm, model_dir, dtype)
            local = load_shard(model_dir, dtype, comm, moe_a2a, kv_cache_tokens)
            self.rank_weight_bytes = gather_weight_bytes(comm, local)
            self.rank_info = gather_rank_info(comm)
        except BaseException:
            self._stop_group()
            raise
        return DriverRunner(local, comm)

    def _stop_group(self) -> None:
        if self.group is not None:
            self.group.stop()
            self.group = None

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
        try:
            self.engine.run_to_completion()
        except BaseException:
            self.shutdown(graceful=False)  # an EP error or Ctrl-C leaves the group unusable
            raise
        return [RequestOutput.of(i, s) for i, s in enumerate(seqs)]

    def shutdown(self, graceful: bool = True) -> None:
        """End the EP workers (if any) and release the model and cache.

        Graceful: send SHUTDOWN, then wait for the workers. After an error or an interrupt the
        group may be stuck inside a collective, so the workers are ended without a command.
        """
        if graceful and self.engine is not None and not isinstance(self.engine.runner, ModelRunner):
            try:
                self.engine.runner.shutdown()
            except Exception:  # a broken group: fall through to ending the processes
                graceful = False
        if self.group is not None:
            self.group.stop(timeout_s=10.0 if graceful else 0.0)
            self.group = None
        self.engine = None
        self.model = None
