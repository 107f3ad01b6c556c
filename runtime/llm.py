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
LAUNCHERS = ("ray", "mp")


def start_group(launcher: str, model_dir: Path, dtype: str, ep: int, moe_a2a: str, timeout_s: float,
                kv_cache_tokens: int, ray_options=None, worker_overrides: dict[int, dict] | None = None):
    """Start the worker ranks of an EP group with `launcher`; returns the group (its `comm` is rank 0's)."""
    from launch.worker import GroupConfig
    cfg = GroupConfig(model_dir=str(model_dir), dtype=dtype, ep=ep, moe_a2a=moe_a2a,
                      kv_cache_tokens=kv_cache_tokens, timeout_s=timeout_s)
    if launcher == "mp":
        from launch.mp import MPGroup
        return MPGroup(cfg, worker_overrides)
    from launch.ray_group import RayGroup, RayOptions
    return RayGroup(cfg, ray_options or RayOptions(), worker_overrides)



def make_proposer(spec: str, model, runner, confidence_stop: float | None = None, model_dir: Path | None = None,
                  dtype: str = "float32"):
    """The drafter for `spec`: the checkpoint's MTP layer (sharded across EP ranks when the
    runner drives a group, or rank 0's own under METRALE_NO_MTP_EP_PROPOSE=1), prompt lookup, or none."""
    if spec == "mtp":
        from speculative.mtp import MTPProposer
        if isinstance(runner, ModelRunner):
            return MTPProposer(model, runner.cache, confidence_stop)
        if model.mtp is None:
            raise ValueError("this checkpoint has no MTP layer: MTP speculation needs one")
        from speculative.knobs import mtp_ep_propose_enabled
        if not mtp_ep_propose_enabled():
            from ep.local_drafter import load_local_drafter
            return load_local_drafter(model_dir, dtype, runner.comm.rank, runner.comm.world_size, runner.cache,
                                      confidence_stop)
        from ep.shard import ShardedMTPProposer
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


def model_width_cap(model_dir: Path) -> int | None:
    """The width cap of the model folder's metrale.toml (`[behavior] mtp_max_seqs`) when no cap
    was published (the CLI publishes the one it resolved); None leaves the engine to the default."""
    from runtime.config import ConfigError, load_behavior
    from speculative.ladder import mtp_ladder_disabled, mtp_max_seqs_published, resolve_mtp_max_seqs
    if mtp_max_seqs_published():
        return None
    value = load_behavior(model_dir).get("mtp_max_seqs")
    if value is None:
        return None
    if not isinstance(value, int):
        raise ConfigError(f"{model_dir}/metrale.toml [behavior] mtp_max_seqs={value!r} is not an integer")
    return resolve_mtp_max_seqs(None, value, mtp_ladder_disabled())[0]


class LLM:
    """Loads a checkpoint folder and generates for batches of prompts (text or token ids)."""

    def __init__(self, model: str | Path, dtype: str = "float32", *, kv_cache_tokens: int = 32768,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, spec: str = "none",
                 num_drafts: int = 3, spec_verify: str = "exact", draft_policy: str = "ladder",
                 mtp_max_seqs: int | None = None, draft_confidence_stop: float | None = None, ep: int = 1,
                 moe_a2a: str = "alltoall", ep_timeout_s: float = 60.0, launcher: str = "ray",
                 ray_options=None, max_restarts: int = 3, worker_overrides: dict[int, dict] | None = None,
                 comm=None, tree_shape: str | None = None) -> None:
        """`ep` > 1 starts ep - 1 worker ranks with `launcher` ("ray": Ray actors in a placement
        group, `ray_options` a `launch.ray_group.RayOptions`; "mp": spawned processes) and
        supervises them: a dead rank restarts the group up to `max_restarts` times. `comm`, an
        already joined communicator of rank 0 (torchrun), replaces the launcher (no restarts).
        `tree_shape` ("1,2,2") drafts trees with the MTP drafter; None takes METRALE_TREE_SHAPE
        when spec is mtp."""
        model_dir = Path(model)
        tree = resolve_tree_shape(tree_shape, spec)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {str(model_dir)!r} does not exist")
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher={launcher!r}: expected one of {', '.join(LAUNCHERS)}")
        if spec not in SPEC_METHODS:
            raise ValueError(f"spec={spec!r} is not a speculation method (expected one of {', '.join(SPEC_METHODS)})")
        self.model_dir = model_dir
        self.dtype, self.moe_a2a, self.kv_cache_tokens = dtype, moe_a2a, kv_cache_tokens
        self.spec, self.draft_confidence_stop = spec, draft_confidence_stop
        self.group = None
        self.engine = None
        self.supervisor = None
        self.rank_weight_bytes: list[int] = []
        self.rank_info: list[dict] = [local_rank_info(0)]
        if ep > 1 or comm is not None:
            if comm is None:
                self.group = start_group(launcher, model_dir, dtype, ep, moe_a2a, ep_timeout_s, kv_cache_tokens,
                                         ray_options, worker_overrides)
                comm = self.group.comm
            runner = self._join_group(comm)
        else:
            runner = ModelRunner(load_model(model_dir, dtype), kv_cache_tokens=kv_cache_tokens)
        self.model = runner.model
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        config = EngineConfig(kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              num_drafts=num_drafts if spec != "none" else 0, spec_verify=spec_verify,
                              draft_policy=draft_policy, tree_shape=tree,
                              mtp_max_seqs=mtp_max_seqs if mtp_max_seqs is not None else model_width_cap(model_dir))
        try:
            proposer = make_proposer(spec, self.model, runner, draft_confidence_stop, model_dir, dtype)
        except BaseException:
            if not isinstance(runner, ModelRunner):
                runner.shutdown()
            self._stop_group()
            raise
        drafter = getattr(proposer, "model", None)
        if drafter is not None and drafter is not self.model and self.rank_weight_bytes:  # rank 0's own drafter
            self.rank_weight_bytes[0] += sum(p.numel() * p.element_size() for p in drafter.parameters())
        self.engine = Engine(runner, self.tokenizer, config, proposer)
        if self.group is not None:
            from launch.supervisor import Supervisor
            self.supervisor = Supervisor(self, max_restarts)

    def _join_group(self, comm):
        """Rank 0's part of starting a group: handshake, its shard, every rank's pid and node."""
        from ep.shard import DriverRunner, driver_handshake, gather_rank_info, gather_weight_bytes, load_shard
        self.comm = comm
        try:
            driver_handshake(comm, self.model_dir, self.dtype)
            local = load_shard(self.model_dir, self.dtype, comm, self.moe_a2a, self.kv_cache_tokens)
            self.rank_weight_bytes = gather_weight_bytes(comm, local)
            info = gather_rank_info(comm)
        except BaseException as exc:
            report = self.group.failure_report() if self.group is not None else ""
            self._stop_group()
            if report:
                from launch.worker import GroupStartError
                raise GroupStartError(f"the EP group did not start: {report}") from exc
            raise
        nodes = self.group.nodes() if self.group is not None else [r["host"] for r in info]
        self.rank_info = [{**r, "node": node} for r, node in zip(info, nodes)]
        return DriverRunner(local, comm)

    def restart_group(self) -> None:
        """Stop every rank, start a fresh group, reload the weights, give the engine the new
        runner (which queues every unfinished request again)."""
        self.group.stop(timeout_s=0)
        self.group.start()
        runner = self._join_group(self.group.comm)
        proposer = make_proposer(self.spec, runner.model, runner, self.draft_confidence_stop, self.model_dir,
                                 self.dtype)
        self.model = runner.model
        self.engine.reset(runner, proposer)

    def _stop_group(self, timeout_s: float = 0.0) -> None:
        if self.group is not None:
            self.group.stop(timeout_s=timeout_s)
            self.group.close()
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
            self._run_to_completion()
        except BaseException:
            self.shutdown(graceful=False)  # an EP error or Ctrl-C leaves the group unusable
            raise
        return [RequestOutput.of(i, s) for i, s in enumerate(seqs)]

    def _run_to_completion(self) -> None:
        """Step until every request is done; with a supervised group, a dead rank restarts it."""
        import torch
        sup = self.supervisor
        with torch.inference_mode():
            while self.engine.has_unfinished():
                why = sup.pending() if sup is not None else None
                if why is not None:
                    sup.recover(why)
                try:
                    self.engine.step()
                except Exception as exc:
                    if sup is None or not sup.handles(exc):
                        raise
                    sup.recover(sup.reason(exc))

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
        self._stop_group(timeout_s=10.0 if graceful else 0.0)
        self.engine = None
        self.model = None
