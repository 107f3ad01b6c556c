"""The communicator: torch.distributed with gloo on CPU and NCCL on CUDA, a timeout on every collective.

Control words are u32 on the wire as int32 bit patterns (torch.distributed has no uint32
collectives); `words_to_u32` / `u32_to_words` convert. Every rank must call every collective of a
step in the same order, even with nothing to send.
"""
from __future__ import annotations

import datetime as dt
import os

import numpy as np
import torch
import torch.distributed as dist


# How long a group's start waits for a rank (the rendezvous, then the start's collectives): ranks
# import and load their shards at their own pace, minutes for a large model or a loaded host. A
# rank that dies meanwhile is seen at once (its connections close; the launcher watches it).
START_TIMEOUT_S = 300.0


class CommError(RuntimeError):
    """A collective failed: a peer died, the link broke, or it timed out."""


def u32_to_words(values: list[int] | np.ndarray, device: torch.device | str) -> torch.Tensor:
    """u32 values -> int32 words on `device` (the communicator's: NCCL sends device tensors only)."""
    arr = np.asarray(values, dtype=np.uint64)
    if arr.size and int(arr.max()) > 0xFFFFFFFF:
        raise ValueError(f"value {int(arr.max())} does not fit in u32")
    return torch.from_numpy(arr.astype(np.uint32).view(np.int32).copy()).to(device)


def words_to_u32(words: torch.Tensor) -> list[int]:
    """int32 words (on any device; read back on the host) -> u32 values."""
    return words.cpu().numpy().astype(np.int32).view(np.uint32).astype(np.int64).tolist()


def backend_for(device: torch.device) -> str:
    """NCCL for a rank on a GPU, gloo on the CPU: chosen by where the tensors live, never by
    whether the host has CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


# Under NCCL a collective's timeout alone times only its enqueue: a dead peer leaves the kernel
# waiting until NCCL's watchdog aborts the whole process, and the `CommError` restarts rely on never
# comes. With blocking waits a failed or timed-out collective raises in the calling thread (then a
# `CommError`), and error handling 2 (clean up only) aborts the communicator without killing the
# process. Set before the group starts; a value already in the environment is kept.
NCCL_ERROR_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def nccl_error_env(environ: dict) -> dict:
    """`NCCL_ERROR_ENV` set into `environ` (os.environ) where absent; returns what it set."""
    added = {k: v for k, v in NCCL_ERROR_ENV.items() if k not in environ}
    environ.update(added)
    return added


class Communicator:
    def __init__(self, *, rank: int, world_size: int, init_method: str | None, timeout_s: float = 60.0,
                 device: torch.device | str, join_group: bool | None = None) -> None:
        """A rank of the group at `init_method`, joined now; None builds it unjoined (a warm standby
        loads its shard first), and `join` joins later. The layers made parallel keep this object,
        so a rank that `join`s a fresh group after `close` keeps its shard. This rank's tensors
        (weights, cache, every collective's buffers) live on `device`, which picks the backend
        (`backend_for`). `join_group`: run every collective through a process group; None joins
        only when world_size > 1 (a single rank's collectives are then no-ops), True also at world
        size 1 (a check of the backend through the EP code path)."""
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.backend == "nccl":
            nccl_error_env(os.environ)
        self.joined = world_size > 1 if join_group is None else join_group
        if world_size > 1 and self.backend == "gloo":
            # Ranks share the host's cores: more threads than cores per rank only adds contention.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        self.comm_seconds = 0.0  # wall time spent inside collectives (for the step split)
        # Bytes this rank puts on the wire, by collective, counted from the tensors and splits (a
        # ring's share for all_reduce and all_gather: 2(N-1)/N and (N-1)/N of the result; an
        # all_to_all's rows for other ranks; a broadcast's tensor from its source).
        self.wire_bytes: dict[str, int] = {}
        self._listening = None   # rank 0's rendezvous store opened by `listen`, until `join` takes it
        if init_method is not None:
            self.join(init_method)

    def join(self, init_method: str) -> None:
        """Join the group at `init_method` (after `close` for a fresh group: a new address). At a
        `tcp://host:port` the rendezvous waits up to START_TIMEOUT_S (or the collective timeout when
        longer) for every rank to arrive, since a rank may still be importing and loading. Other
        methods (torchrun's env://) go to torch as they are. The start's collectives (handshake,
        shard sizes, rank info) wait as long, since ranks load their shards at their own pace;
        `started` then sets `timeout_s` for serving."""
        if not self.joined:
            return
        timeout = dt.timedelta(seconds=max(START_TIMEOUT_S, self.timeout_s))
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        if not init_method.startswith("tcp://") or not host or not port.isdigit():
            dist.init_process_group(self.backend, init_method=init_method, rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
            return
        store, self._listening = self._listening, None
        if store is None or f"tcp://{host}:{store.port}" != init_method:
            store = dist.TCPStore(host, int(port), self.world_size, is_master=self.rank == 0, timeout=timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)

    def listen(self, host: str) -> str:
        """Rank 0 of a launcher: open the rendezvous store on a port the system picks, and return
        its `tcp://host:port` for the workers and for `join`. The port is held from now on, so no
        other process takes it while the workers start (a port merely found free can be, and was,
        taken in those seconds: EADDRINUSE at `join`)."""
        if self.rank != 0:
            raise ValueError(f"rank {self.rank}: only rank 0 opens the rendezvous")
        timeout = dt.timedelta(seconds=max(START_TIMEOUT_S, self.timeout_s))
        self._listening = dist.TCPStore(host, 0, self.world_size, is_master=True, timeout=timeout,
                                        wait_for_workers=False)
        return f"tcp://{host}:{self._listening.port}"

    def started(self) -> None:
        """The group has started: every collective from now on times out after `timeout_s`."""
        if self.joined and dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(dt.timedelta(seconds=self.timeout_s))

    def _run(self, what: str, fn, *args, **kwargs):
        if not self.joined:
            return None
        import time
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError on a dead peer or timeout
            raise CommError(f"rank {self.rank}: {what} failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                            "a peer rank died or the link broke") from exc
        finally:
            self.comm_seconds += time.perf_counter() - t0

    def _count(self, what: str, nbytes: float) -> None:
        if self.joined:
            self.wire_bytes[what] = self.wire_bytes.get(what, 0) + int(nbytes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._count("broadcast", _nbytes(tensor) if self.rank == src else 0)
        self._run("broadcast", dist.broadcast, tensor, src=src)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        self._count("all_reduce", 2 * (self.world_size - 1) / self.world_size * _nbytes(tensor))
        self._run("all_reduce", dist.all_reduce, tensor, op=ops[op])
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [world * n, ...], rank-major."""
        if not self.joined:
            return tensor
        out = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        self._count("all_gather", (self.world_size - 1) * _nbytes(tensor))
        self._run("all_gather", gather, out, tensor.contiguous())
        return out

    def all_to_all(self, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Uneven all-to-all along dim 0. The caller must have exchanged and checked the splits:
        gloo does not detect mismatched sizes (it returns stale data)."""
        return self.all_to_all_start(tensor, send_splits, recv_splits, async_op=False).wait()

    def all_to_all_start(self, tensor: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                         async_op: bool = True) -> Pending:
        """`all_to_all` started and left in flight (`async_op`): its `Pending.wait` gives the output.
        Every rank must start a group's collectives in the same order (in flight ones included)."""
        out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
        if not self.joined:
            out.copy_(tensor)
            return Pending(self, "all_to_all", None, out)
        row = _nbytes(tensor[:1]) if tensor.shape[0] else 0
        self._count("all_to_all", (sum(send_splits) - send_splits[self.rank]) * row)
        work = self._run("all_to_all", dist.all_to_all_single, out, tensor.contiguous(), recv_splits, send_splits,
                         async_op=async_op)
        return Pending(self, "all_to_all", work, out)

    def barrier(self) -> None:
        if self.joined:
            self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        if self.joined and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group cannot always be torn down; the process exits anyway
                pass


class Pending:
    """A collective in flight (`Communicator.all_to_all_start`): `wait` blocks until it is done,
    at most the communicator's collective timeout, and returns its output; a failure or timeout
    raises `CommError` as a blocking collective does. The wait counts in `comm_seconds` (a
    collective's exposed time: what the overlapped compute did not hide)."""

    def __init__(self, comm: Communicator, what: str, work, out: torch.Tensor) -> None:
        self.comm, self.what, self.work, self.out = comm, what, work, out

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            work, self.work = self.work, None
            self.comm._run(f"{self.what} (wait)", work.wait, dt.timedelta(seconds=self.comm.timeout_s))
        return self.out


class GroupComm:
    """The collectives of the group of `size` consecutive ranks this rank belongs to (an attention
    group of `--attention-tp`, ep.dp), over `parent`'s process group. Its process groups are made
    by `bind`, which every rank runs at the same point of the start (after the handshake): torch
    makes every group with every rank. Bytes count in the parent's `wire_bytes`."""

    def __init__(self, parent: Communicator, size: int) -> None:
        self.parent, self.world_size = parent, size
        self.rank = parent.rank % size
        self.device = parent.device
        self.pg = None

    def bind(self) -> None:
        """Make every group's process group (collective over all ranks), keep this rank's."""
        p = self.parent
        self.pg = None
        if not p.joined:
            return
        for first in range(0, p.world_size, self.world_size):
            pg = dist.new_group(list(range(first, first + self.world_size)), backend=p.backend)
            if first <= p.rank < first + self.world_size:
                self.pg = pg

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size > 1:
            self.parent._count("all_reduce", 2 * (self.world_size - 1) / self.world_size * _nbytes(tensor))
            self.parent._run("all_reduce", dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=self.pg)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank of the group -> [size * n, ...], group-rank-major."""
        if self.world_size == 1 or not self.parent.joined:
            return tensor
        out = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
        self.parent._count("all_gather", (self.world_size - 1) * _nbytes(tensor))
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        self.parent._run("all_gather", gather, out, tensor.contiguous(), group=self.pg)
        return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
