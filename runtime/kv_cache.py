"""Paged KV cache: a fixed pool of blocks, a block table per sequence, rewind to any shorter length.

Shapes: L cache layers (target layers plus the MTP layer), S cells = num_blocks * block_size,
nkv key/value heads, D head dim. A token at position p of a sequence lives in cell
`block_table[p // block_size] * block_size + p % block_size` (a cell is one token's place in the
pool; "slot", elsewhere, names a sequence's place, docs/design.md §1).
"""
from __future__ import annotations

import torch


MOVE_SHIFT = 3
MAX_MOVE_DISTANCE = (1 << MOVE_SHIFT) - 1   # tree verify rows lie at most 7 rows past their place


def pack_move(src: int, dst: int) -> int:
    """A move's two positions in one journal word: dst << 3 | (src - dst), src - dst in 1..7."""
    if not 1 <= src - dst <= MAX_MOVE_DISTANCE or dst < 0:
        raise ValueError(f"cannot move a row from position {src} to {dst}: only 1..{MAX_MOVE_DISTANCE} "
                         "rows back are journaled")
    return dst << MOVE_SHIFT | (src - dst)


def unpack_move(word: int) -> tuple[int, int]:
    """(src, dst) of a packed move."""
    dst = word >> MOVE_SHIFT
    return dst + (word & MAX_MOVE_DISTANCE), dst


class CacheFullError(RuntimeError):
    """Raised when a reservation does not fit; the scheduler checks `can_reserve` first."""


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be at least 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        num_cells = num_blocks * block_size
        self.k = torch.zeros(num_layers, num_cells, num_kv_heads, head_dim, dtype=dtype)  # [L, S, nkv, D]
        self.v = torch.zeros_like(self.k)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        # When a list, every reserve/rewind/move/free is also recorded here as (op, seq_id, length)
        # (a move's length word is `pack_move(src, dst)`), so
        # the caches of other ranks can replay it: the allocator is deterministic, so the same
        # operations give the same block tables everywhere.
        self.journal: list[tuple[str, int, int]] | None = None
        # Cell ids of every position a sequence's blocks cover, rebuilt when its table changes.
        self._cell_cache: dict[int, torch.Tensor] = {}

    def shared_plane(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> "PagedKVCache":
        """A cache with its own key/value tensors but this cache's blocks, tables and lengths
        (the same objects): every reserve, rewind and free here applies there and back. Rank 0's
        drafter of its own (full attention heads) keeps its rows in one."""
        other = PagedKVCache(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             num_blocks=1, block_size=self.block_size, dtype=dtype)
        num_cells = self.num_blocks * self.block_size
        other.num_blocks = self.num_blocks
        other.k = torch.zeros(num_layers, num_cells, num_kv_heads, head_dim, dtype=dtype)
        other.v = torch.zeros_like(other.k)
        other._free, other._tables, other._lengths = self._free, self._tables, self._lengths
        other._cell_cache = self._cell_cache
        return other

    # --- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def num_free_tokens(self) -> int:
        """Tokens that still fit in the pool, counting only whole free blocks."""
        return len(self._free) * self.block_size

    def blocks_needed(self, seq_id: int, new_length: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-new_length // self.block_size) - have)

    def can_reserve(self, seq_id: int, new_length: int) -> bool:
        """True when sequence `seq_id` can grow to `new_length` tokens without evicting anyone."""
        return self.blocks_needed(seq_id, new_length) <= len(self._free)

    def length(self, seq_id: int) -> int:
        return self._lengths.get(seq_id, 0)

    # --- changes ----------------------------------------------------------------------------
    def reserve(self, seq_id: int, new_length: int) -> None:
        """Grow `seq_id` to hold `new_length` tokens (allocating blocks); never shrinks."""
        need = self.blocks_needed(seq_id, new_length)
        if need > len(self._free):
            raise CacheFullError(f"sequence {seq_id} needs {need} more blocks, {len(self._free)} free")
        if self.journal is not None:
            self.journal.append(("reserve", seq_id, new_length))
        table = self._tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self._free.pop())
        self._lengths[seq_id] = max(self._lengths.get(seq_id, 0), new_length)

    def rewind(self, seq_id: int, new_length: int) -> None:
        """Shrink `seq_id` to its first `new_length` tokens and give back blocks no longer used."""
        cur = self._lengths.get(seq_id, 0)
        if not 0 <= new_length <= cur:
            raise ValueError(f"cannot rewind sequence {seq_id} from {cur} to {new_length} tokens")
        if self.journal is not None:
            self.journal.append(("rewind", seq_id, new_length))
        table = self._tables[seq_id]
        keep = -(-new_length // self.block_size)
        if len(table) > keep:
            self._cell_cache.pop(seq_id, None)
        while len(table) > keep:
            self._free.append(table.pop())
        self._lengths[seq_id] = new_length

    def move(self, seq_id: int, src: int, dst: int) -> None:
        """Copy the keys/values of position `src` of `seq_id` to position `dst` in every layer (the
        taken hedge of a tree verify goes to its depth's place; rows past it are rewound after)."""
        length = self._lengths.get(seq_id, 0)
        word = pack_move(src, dst)
        if src >= length:
            raise ValueError(f"cannot move position {src} of sequence {seq_id}: length {length}")
        if self.journal is not None:
            self.journal.append(("move", seq_id, word))
        cells = self.cells(seq_id, 0, src + 1)
        s, d = int(cells[src]), int(cells[dst])
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]

    def free(self, seq_id: int) -> None:
        if self.journal is not None:
            self.journal.append(("free", seq_id, 0))
        self._cell_cache.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            self._free.append(block)
        self._lengths.pop(seq_id, None)

    def replay(self, op: str, seq_id: int, length: int) -> None:
        """Apply one journal entry recorded by another rank's cache."""
        if op == "reserve":
            self.reserve(seq_id, length)
        elif op == "rewind":
            self.rewind(seq_id, length)
        elif op == "move":
            self.move(seq_id, *unpack_move(length))
        elif op == "free":
            self.free(seq_id)
        else:
            raise ValueError(f"unknown cache operation {op!r}")

    # --- addressing -------------------------------------------------------------------------
    def cells(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Cell ids of positions start..end-1 of `seq_id` (all must be reserved) [end - start]."""
        if end > self._lengths.get(seq_id, 0):
            raise ValueError(f"positions up to {end} of sequence {seq_id} are not reserved "
                             f"(length {self._lengths.get(seq_id, 0)})")
        table = self._tables[seq_id]
        cached = self._cell_cache.get(seq_id)
        if cached is None or cached.shape[0] != len(table) * self.block_size:
            blocks = torch.tensor(table, dtype=torch.long)
            cached = (blocks[:, None] * self.block_size + torch.arange(self.block_size)[None, :]).reshape(-1)
            self._cell_cache[seq_id] = cached
        return cached[start:end]

    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, nkv, D] into `cells` [T] of cache layer `layer`."""
        self.k[layer].index_copy_(0, cells, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, cells, v.to(self.v.dtype))
