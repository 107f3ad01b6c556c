"""What every worker rank runs once it has joined the group, whoever launched it (mp, Ray, torchrun)."""
from __future__ import annotations

from dataclasses import dataclass

from ep.comm import CommError, Communicator


class GroupStartError(RuntimeError):
    """An EP group could not start: no room for its ranks, or a rank failed while joining."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupConfig:
    """What a launcher needs to start the worker ranks of one EP group."""
    model_dir: str
    dtype: str
    ep: int
    moe_a2a: str = "alltoall"
    kv_cache_tokens: int = 32768
    timeout_s: float = 60.0


def serve_rank(comm: Communicator, model_dir: str, dtype: str, moe_a2a: str, kv_cache_tokens: int) -> tuple[int, str]:
    """Agree on the handshake, load this rank's shard, then execute rank 0's commands until it
    shuts the group down. Returns (exit code, message): (0, "") on a clean shutdown, 3 when the
    group broke, 2 for any other failure; the group is always left."""
    from ep.shard import gather_rank_info, gather_weight_bytes, load_shard, worker_handshake, worker_loop
    try:
        worker_handshake(comm, model_dir, dtype)
        runner = load_shard(model_dir, dtype, comm, moe_a2a, kv_cache_tokens)
        gather_weight_bytes(comm, runner)
        gather_rank_info(comm)
        worker_loop(runner, comm)
        return 0, ""
    except CommError as exc:
        return 3, f"metrale worker rank {comm.rank}: {exc}"
    except Exception as exc:
        return 2, f"metrale worker rank {comm.rank}: {type(exc).__name__}: {exc}"
    finally:
        comm.close()
