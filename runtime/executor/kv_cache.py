"""Paged KV cache: a fixed pool of blocks, a block table per sequence, rewind to any shorter length.

Blocks are reference-counted: a full block may sit in several sequences' tables (a shared prompt
prefix, attached by `attach`), and nobody writes into it, since every write lands at or past a
sequence's `num_computed` and only blocks wholly below it are shared. A block whose count drops to
0 joins the free queue but keeps its contents; `reserve` takes the queue's head, so blocks that
may be attached again (freed with `keep`) wait at the tail, least recently used first out, and
blocks holding nothing worth keeping (rewound rows, the tail of a freed sequence) go to the head.
`epoch(block)` changes whenever a block is handed out again, so an index of contents (rank 0's
`engine.prefix_cache.PrefixCache`) can tell a block that still holds what it indexed.

Shapes: L cache layers (target layers plus the MTP layer), S cells = num_blocks * block_size,
nkv key/value heads, D head dim. A latent cache (`latent_dim` set, multi-head latent attention,
runtime.model.mla) stores keys only, one head of [latent ; rotary key]; its values are a view of the
keys' first `latent_dim` channels, so a token costs L * D values instead of L * 2 * nkv * D.
A token at position p of a sequence lives in cell
`block_table[p // block_size] * block_size + p % block_size` (a cell is one token's place in the
pool; "slot", elsewhere, names a sequence's place, docs/design.md §1).

Pools (`split_pools`, data-parallel attention, docs/design.md §4.3): the book may count the blocks
of several equal pools, one a rank, while this process holds the memory of its own pool only. A
sequence takes all its blocks from one pool, chosen at its first reservation (the pool with the
most free blocks, then the fewest sequences, then the lowest index: the same on every rank that
replays the same journal); block b of pool p is cell block `b - p * num_blocks` of that pool's
memory, and only the local pool's sequences have cells here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class BlockBook:
    """Who holds which block: shared by a cache and its planes (`PagedKVCache.shared_plane`)."""
    free: list[OrderedDict[int, None]]            # per pool: blocks nobody holds, the next one handed out first
    refs: list[int]                               # holders of each block
    epochs: list[int]                             # bumped each time a block is handed out by `reserve`
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    num_attached: dict[int, int] = field(default_factory=dict)   # leading blocks a sequence was attached
    # Cell ids of every position a sequence's blocks cover, rebuilt when its table changes.
    cell_cache: dict[int, torch.Tensor] = field(default_factory=dict)
    pool_of: dict[int, int] = field(default_factory=dict)        # with several pools: each sequence's
    pool_seqs: list[int] = field(default_factory=lambda: [0])    # sequences holding blocks in each pool

    @classmethod
    def of(cls, num_blocks: int, pools: int = 1) -> BlockBook:
        """`pools` equal pools of `num_blocks` blocks each (ids p * num_blocks ... for pool p)."""
        total = num_blocks * pools
        return cls(free=[OrderedDict.fromkeys(range(p * num_blocks, (p + 1) * num_blocks)) for p in range(pools)],
                   refs=[0] * total, epochs=[0] * total, pool_seqs=[0] * pools)


class LayerStates:
    """The layer-state backend of a cache: what a model keeps per sequence besides its paged keys and
    values, chosen once by the runner (`choose_layer_states`). This one, `NO_LAYER_STATES`, keeps
    nothing (every mixer is attention over the paged cache, a sparse indexer's key included: it
    sits in the MLA cell); `runtime.model.linear_attention.RecurrentStates` keeps a hybrid model's
    conv and recurrent states. `step(chunks)` gives a step's view (handed to the layers as
    `PagedAttention.states`), `rewind` / `free` / `move` follow the sequence's blocks, and
    `attachable` says whether a prefix-cache hit can attach blocks (it cannot where the state at
    a block's end is not kept)."""

    name = "none"
    attachable = True
    bytes_per_sequence = 0

    def bytes_reserved(self, sequences: int, rows: int) -> int:
        """Memory `sequences` running sequences' states take at most while each steps `rows` rows:
        what a cache sized from free memory leaves them (`kv_tokens_for_memory`)."""
        return 0

    def step(self, chunks) -> None:
        return None

    def rewind(self, seq_id: int, new_length: int) -> None:
        pass

    def free(self, seq_id: int) -> None:
        pass

    def move(self, seq_id: int, src: int, dst: int) -> None:
        pass


NO_LAYER_STATES = LayerStates()


class PagedKVCache:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, latent_dim: int | None = None,
                 device: torch.device | str) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be at least 1")
        if latent_dim is not None and not (num_kv_heads == 1 and 0 < latent_dim <= head_dim):
            raise ValueError(f"a latent cache has one head and latent_dim={latent_dim} within head_dim={head_dim}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.latent_dim = latent_dim
        self.device = torch.device(device)
        self.k, self.v = self._planes(num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype)
        self.book = BlockBook.of(num_blocks)
        self.pool = 0   # the pool whose memory this cache holds (`split_pools`)
        # When a list, every reserve/attach/rewind/move/free is also recorded here as (op, seq_id, word)
        # (the length; an attach's block; a move's `pack_move(src, dst)`; a free's kept blocks), so
        # the caches of other ranks can replay it: the allocator is deterministic, so the same
        # operations give the same block tables everywhere.
        self.journal: list[tuple[str, int, int]] | None = None
        # The attention backend of every step planned on this cache
        # (runtime.executor.attention.choose_attention_backend), chosen once at start.
        self.attention = None
        # The layer-state backend (`LayerStates`): what the model keeps per sequence besides paged
        # keys and values (a hybrid model's recurrent states, runtime.model.linear_attention),
        # rewound and freed with the sequence's blocks; the runner sets it once.
        self.states: LayerStates = NO_LAYER_STATES

    def shared_plane(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> "PagedKVCache":
        """A cache with its own key/value tensors but this cache's blocks, tables and lengths
        (the same `BlockBook`): every reserve, rewind and free here applies there and back. Rank
        0's drafter of its own (full attention heads) keeps its rows in one."""
        other = PagedKVCache(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             num_blocks=1, block_size=self.block_size, dtype=dtype, latent_dim=self.latent_dim,
                             device=self.device)
        other.num_blocks = self.num_blocks
        other.k, other.v = other._planes(num_layers, self.num_blocks * self.block_size, num_kv_heads, head_dim, dtype)
        other.book, other.pool = self.book, self.pool
        return other

    def split_pools(self, pools: int, pool: int) -> None:
        """Count `pools` pools of this cache's size (one a rank of a data-parallel group, which
        replays the same journal), this process holding pool `pool`'s memory. Before any
        reservation."""
        if self.book.tables or not 0 <= pool < pools:
            raise ValueError(f"cannot split a cache into {pools} pools as pool {pool} once it holds sequences")
        self.book = BlockBook.of(self.num_blocks, pools)
        self.pool = pool

    @property
    def num_pools(self) -> int:
        return len(self.book.free)

    def pool_of(self, seq_id: int) -> int:
        """The pool of `seq_id`'s blocks; for a sequence holding none, the pool its first
        reservation will take (the most free blocks, then the fewest sequences, the lowest index)."""
        book = self.book
        if len(book.free) == 1:
            return 0
        got = book.pool_of.get(seq_id)
        if got is None:
            got = min(range(len(book.free)), key=lambda p: (-len(book.free[p]), book.pool_seqs[p], p))
        return got

    def _planes(self, num_layers: int, num_cells: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # One cell past the blocks: the scratch cell padded rows of a static step write to (`scratch_cell`).
        k = torch.zeros(num_layers, num_cells + 1, num_kv_heads, head_dim, dtype=dtype,
                        device=self.device)                                        # [L, S+1, nkv, D]
        if self.latent_dim is not None:
            return k, k[..., :self.latent_dim]                                     # values: a view of keys
        return k, torch.zeros_like(k)

    @property
    def scratch_cell(self) -> int:
        """A cell outside every block: padded rows write there and nobody reads it as context."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all cache layers (block padding aside)."""
        per_cell = self.k[:, 0].numel() + (0 if self.latent_dim is not None else self.v[:, 0].numel())
        return per_cell * self.k.element_size()

    # --- accounting -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds (some may still hold a cached prefix until they are handed out),
        over every pool."""
        return sum(len(q) for q in self.book.free)

    @property
    def total_blocks(self) -> int:
        """The blocks of every pool (`num_blocks` with one pool)."""
        return self.num_blocks * len(self.book.free)

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence can hold: one pool's."""
        return self.num_blocks * self.block_size

    def num_free_tokens(self) -> int:
        """Tokens that still fit in the pools, counting only whole free blocks."""
        return self.num_free_blocks * self.block_size

    def blocks_needed(self, seq_id: int, new_length: int) -> int:
        have = len(self.book.tables.get(seq_id, ()))
        return max(0, -(-new_length // self.block_size) - have)

    def can_reserve(self, seq_id: int, new_length: int, attach: list[int] | tuple[int, ...] = ()) -> bool:
        """True when sequence `seq_id`, after attaching the blocks `attach`, can grow to
        `new_length` tokens from free blocks (attaching a free block takes it off the queue)."""
        taken = sum(1 for b in attach if self.book.refs[b] == 0)
        free = self.book.free[self.pool_of(seq_id)]
        return self.blocks_needed(seq_id, new_length) - len(attach) <= len(free) - taken

    def length(self, seq_id: int) -> int:
        return self.book.lengths.get(seq_id, 0)

    def block_table(self, seq_id: int) -> list[int]:
        """The blocks of `seq_id`, in position order (empty when it holds none); do not change it."""
        return self.book.tables.get(seq_id, [])

    def num_attached_tokens(self, seq_id: int) -> int:
        """Leading positions of `seq_id` that came, computed, from blocks it was attached."""
        return self.book.num_attached.get(seq_id, 0) * self.block_size

    def refs(self, block: int) -> int:
        return self.book.refs[block]

    def epoch(self, block: int) -> int:
        return self.book.epochs[block]

    # --- changes ----------------------------------------------------------------------------
    def reserve(self, seq_id: int, new_length: int) -> None:
        """Grow `seq_id` to hold `new_length` tokens (taking blocks off the free queue's head,
        which evicts whatever they held); never shrinks."""
        book = self.book
        need = self.blocks_needed(seq_id, new_length)
        pool = self.pool_of(seq_id)
        free = book.free[pool]
        if need > len(free):
            raise CacheFullError(f"sequence {seq_id} needs {need} more blocks, {len(free)} free")
        if self.journal is not None:
            self.journal.append(("reserve", seq_id, new_length))
        if len(book.free) > 1 and seq_id not in book.pool_of:
            book.pool_of[seq_id] = pool
            book.pool_seqs[pool] += 1
        table = book.tables.setdefault(seq_id, [])
        for _ in range(need):
            block, _ = free.popitem(last=False)
            book.refs[block] = 1
            book.epochs[block] += 1
            table.append(block)
        book.lengths[seq_id] = max(book.lengths.get(seq_id, 0), new_length)

    def attach(self, seq_id: int, block: int) -> None:
        """Append the full block `block` (holding this sequence's next `block_size` positions,
        computed by another) to the table of `seq_id`, which must hold only whole blocks."""
        book = self.book
        if not self.states.attachable:
            raise ValueError(f"cannot attach cached blocks to a sequence with {self.states.name} layer state: its "
                             "state at the block's end is not kept")
        table = book.tables.setdefault(seq_id, [])
        if book.lengths.get(seq_id, 0) != len(table) * self.block_size or not 0 <= block < self.num_blocks:
            raise ValueError(f"cannot attach block {block} to sequence {seq_id} of length "
                             f"{book.lengths.get(seq_id, 0)}: it must end on a block boundary")
        if len(book.free) > 1:
            raise ValueError("cannot attach cached blocks to a cache split into pools (no prefix cache there)")
        if self.journal is not None:
            self.journal.append(("attach", seq_id, block))
        if book.refs[block] == 0:
            del book.free[0][block]
        book.refs[block] += 1
        table.append(block)
        book.lengths[seq_id] = len(table) * self.block_size
        book.num_attached[seq_id] = book.num_attached.get(seq_id, 0) + 1
        book.cell_cache.pop(seq_id, None)

    def _release(self, block: int, keep: bool) -> None:
        book = self.book
        book.refs[block] -= 1
        if book.refs[block] == 0:
            free = book.free[block // self.num_blocks]
            free[block] = None
            if not keep:
                free.move_to_end(block, last=False)

    def rewind(self, seq_id: int, new_length: int) -> None:
        """Shrink `seq_id` to its first `new_length` tokens and give back blocks no longer used."""
        book = self.book
        cur = book.lengths.get(seq_id, 0)
        if not 0 <= new_length <= cur:
            raise ValueError(f"cannot rewind sequence {seq_id} from {cur} to {new_length} tokens")
        if self.journal is not None:
            self.journal.append(("rewind", seq_id, new_length))
        if new_length < self.num_attached_tokens(seq_id):
            raise ValueError(f"cannot rewind sequence {seq_id} to {new_length} tokens: its first "
                             f"{self.num_attached_tokens(seq_id)} are in shared blocks")
        self.states.rewind(seq_id, new_length)
        table = book.tables[seq_id]
        keep = -(-new_length // self.block_size)
        if len(table) > keep:
            book.cell_cache.pop(seq_id, None)
        while len(table) > keep:
            self._release(table.pop(), keep=False)
        book.lengths[seq_id] = new_length

    def move(self, seq_id: int, src: int, dst: int) -> None:
        """Copy the keys/values of position `src` of `seq_id` to position `dst` in every layer (the
        taken hedge of a tree verify goes to its depth's place; rows past it are rewound after)."""
        length = self.book.lengths.get(seq_id, 0)
        word = pack_move(src, dst)
        if src >= length:
            raise ValueError(f"cannot move position {src} of sequence {seq_id}: length {length}")
        if self.journal is not None:
            self.journal.append(("move", seq_id, word))
        if self.pool_of(seq_id) != self.pool:   # another rank's pool: that rank moves its cells
            return
        table, bs = self.book.tables[seq_id], self.block_size   # cell ids from the host table: no device sync
        base = self.pool * self.num_blocks
        s, d = (table[src // bs] - base) * bs + src % bs, (table[dst // bs] - base) * bs + dst % bs
        self.k[:, d] = self.k[:, s]
        if self.latent_dim is None:
            self.v[:, d] = self.v[:, s]
        if self.states is not None:
            self.states.move(seq_id, src, dst)

    def free(self, seq_id: int, keep: int = 0) -> None:
        """Drop `seq_id`. Its first `keep` blocks, once nobody else holds them, wait at the free
        queue's tail (its later blocks nearer the head), the rest go to the head."""
        book = self.book
        if self.journal is not None:
            self.journal.append(("free", seq_id, keep))
        book.cell_cache.pop(seq_id, None)
        self.states.free(seq_id)
        table = book.tables.pop(seq_id, [])
        for i in range(len(table) - 1, -1, -1):
            self._release(table[i], keep=i < keep)
        book.lengths.pop(seq_id, None)
        book.num_attached.pop(seq_id, None)
        pool = book.pool_of.pop(seq_id, None)
        if pool is not None:
            book.pool_seqs[pool] -= 1

    def replay(self, op: str, seq_id: int, word: int) -> None:
        """Apply one journal entry recorded by another rank's cache."""
        if op == "reserve":
            self.reserve(seq_id, word)
        elif op == "attach":
            self.attach(seq_id, word)
        elif op == "rewind":
            self.rewind(seq_id, word)
        elif op == "move":
            self.move(seq_id, *unpack_move(word))
        elif op == "free":
            self.free(seq_id, word)
        else:
            raise ValueError(f"unknown cache operation {op!r}")

    # --- addressing -------------------------------------------------------------------------
    def cells(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Cell ids of positions start..end-1 of `seq_id` (all must be reserved) [end - start]."""
        book = self.book
        if end > book.lengths.get(seq_id, 0):
            raise ValueError(f"positions up to {end} of sequence {seq_id} are not reserved "
                             f"(length {book.lengths.get(seq_id, 0)})")
        table = book.tables[seq_id]
        cached = book.cell_cache.get(seq_id)
        if cached is None or cached.shape[0] != len(table) * self.block_size:
            blocks = torch.tensor(self._local(seq_id, table), dtype=torch.long, device=self.device)
            offsets = torch.arange(self.block_size, device=self.device)
            cached = (blocks[:, None] * self.block_size + offsets[None, :]).reshape(-1)
            book.cell_cache[seq_id] = cached
        return cached[start:end]

    def context_cells(self, seq_ids: list[int], ends: list[int]) -> torch.Tensor:
        """Cell ids of positions 0..ends[b]-1 of each sequence `seq_ids[b]`, padded with 0 to the
        longest -> [B, max(ends)]: `cells` of each sequence padded as `pad_sequence` pads them, from
        the block tables in ~10 tensor ops whatever B (one `cells` slice per sequence and the
        padding made several per sequence)."""
        book, size = self.book, self.block_size
        width = max(ends)
        num_blocks = -(-width // size)
        rows = []
        for seq_id, end in zip(seq_ids, ends):
            if end > book.lengths.get(seq_id, 0):
                raise ValueError(f"positions up to {end} of sequence {seq_id} are not reserved "
                                 f"(length {book.lengths.get(seq_id, 0)})")
            table = self._local(seq_id, book.tables[seq_id][:-(-end // size)])
            rows.append(table + [0] * (num_blocks - len(table)))
        blocks = torch.tensor(rows, dtype=torch.long, device=self.device)                   # [B, nb]
        offsets = torch.arange(size, device=self.device)
        cells = (blocks[:, :, None] * size + offsets).view(len(rows), num_blocks * size)[:, :width]
        inside = torch.arange(width, device=self.device) < torch.tensor(ends, device=self.device)[:, None]
        return torch.where(inside, cells, 0)

    def _local(self, seq_id: int, blocks: list[int]) -> list[int]:
        """`blocks` of `seq_id` as blocks of this process's pool memory; refused for a sequence of
        another pool (its cells are another rank's)."""
        if len(self.book.free) == 1:
            return blocks
        pool = self.book.pool_of.get(seq_id)
        if pool != self.pool:
            raise ValueError(f"sequence {seq_id}'s blocks are in pool {pool}; this rank holds pool {self.pool}'s")
        base = pool * self.num_blocks
        return [b - base for b in blocks]

    def gather(self, plane: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        """Rows `cells` [...] of a cache plane (`k[layer]` or `v[layer]`, [N, ...]) -> [..., *plane.shape[1:]].
        `index_select` copies whole rows; advanced indexing (`plane[cells]`) goes through the
        generic index kernel, several times slower (design §3.4), and a step gathers every
        layer's context."""
        return plane.index_select(0, cells.reshape(-1)).view(*cells.shape, *plane.shape[1:])

    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, nkv, D] into `cells` [T] of cache layer `layer`. A latent cache writes k only:
        v must be k's first `latent_dim` channels (the view its values are read through)."""
        self.k[layer].index_copy_(0, cells, k.to(self.k.dtype))
        if self.latent_dim is None:
            self.v[layer].index_copy_(0, cells, v.to(self.v.dtype))
