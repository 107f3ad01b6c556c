"""Prefix caching: full KV blocks addressed by their contents, so a prompt that starts like an
earlier one attaches that one's blocks instead of computing them (rank 0 only).

Block j of a sequence (positions j*B..j*B+B-1, B the block size) is keyed by a hash chained over
its parent's key and the tokens at positions j*B..j*B+B, that is its own B tokens *and the one
after it*; the chain's root hashes the model and the dtype. The extra token is there for the MTP
drafter, whose keys/values share the blocks (docs/design.md §3): its row at position i pairs the
target's hidden at i with the token at i + 1, so the drafter rows of a block depend on the first
token of the next block. Equal keys mean equal target and drafter rows; the same tokens at
another position or after another prefix give another key.

A block is indexed once its keys/values are final: every position in it computed and committed
(and, with a drafter, fed to it), and the token after it committed. A lookup attaches at most
`(len - 1) // B` blocks, so at least the last prompt token is computed again and the request gets
its logits (and the drafter the hidden it pairs with the first output token), never writing into
an attached block. Only the worker caches' *allocators* must agree at EP > 1: the index lives on
rank 0 and an attachment travels as a journaled `attach` op naming the block.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from runtime.executor.kv_cache import PagedKVCache


def root_key(model: str, dtype: str) -> bytes:
    """The chain's root: a digest of the model's identity (its normalised config) and the dtype."""
    return hashlib.blake2b(f"metrale prefix cache\0{model}\0{dtype}".encode(), digest_size=16).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block whose parent has key `parent` and that holds `tokens` (its own
    block_size tokens and the one after)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=16).digest()


class PrefixCache:
    """Rank 0's index from block keys to the blocks of `cache` that hold them."""

    def __init__(self, cache: PagedKVCache, root: bytes) -> None:
        self.cache = cache
        self.root = root
        self.block_size = cache.block_size
        self._index: dict[bytes, tuple[int, int]] = {}   # key -> (block, its epoch when indexed)
        self._key_of: dict[int, bytes] = {}               # block -> the key it was indexed under
        self._keys: dict[int, list[bytes]] = {}           # seq_id -> keys of its leading blocks
        self._num_indexed: dict[int, int] = {}            # seq_id -> leading blocks that are final

    def _keys_of(self, seq_id: int, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        """Keys of the first `num_blocks` blocks of `seq_id` (memoised: its tokens never change)."""
        keys = self._keys.setdefault(seq_id, [])
        bs = self.block_size
        while len(keys) < num_blocks:
            j = len(keys)
            keys.append(block_key(keys[-1] if keys else self.root, token_ids[j * bs:(j + 1) * bs + 1]))
        return keys

    def _lookup(self, key: bytes) -> int | None:
        hit = self._index.get(key)
        if hit is None or self.cache.epoch(hit[0]) != hit[1]:
            return None
        return hit[0]

    def match(self, seq_id: int, token_ids: Sequence[int]) -> list[int]:
        """The blocks holding the longest cached prefix of `token_ids`, at most (len - 1) // B of
        them (empty on a miss); nothing is attached yet."""
        keys = self._keys_of(seq_id, token_ids, (len(token_ids) - 1) // self.block_size)
        blocks = []
        for key in keys:
            block = self._lookup(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def attach(self, seq_id: int, blocks: list[int]) -> None:
        """Give the empty sequence `seq_id` the blocks `match` found (journaled for the workers)."""
        for block in blocks:
            self.cache.attach(seq_id, block)
        self._num_indexed[seq_id] = len(blocks)

    def commit(self, seq_id: int, token_ids: Sequence[int], num_final: int) -> None:
        """Index the blocks of `seq_id` that lie wholly in its first `num_final` positions (whose
        keys/values are final) and whose next token is known. A key another live block holds
        already keeps that block."""
        table = self.cache.block_table(seq_id)
        n = min(num_final, len(token_ids) - 1) // self.block_size
        n = min(n, len(table))
        done = self._num_indexed.get(seq_id, 0)
        if n <= done:
            return
        keys = self._keys_of(seq_id, token_ids, n)
        for j in range(done, n):
            block, key = table[j], keys[j]
            if self._lookup(key) is None:
                old = self._key_of.get(block)
                if old is not None and self._index.get(old, (None,))[0] == block:
                    del self._index[old]
                self._index[key] = (block, self.cache.epoch(block))
                self._key_of[block] = key
        self._num_indexed[seq_id] = n

    def free(self, seq_id: int) -> None:
        """Free `seq_id`'s blocks, its indexed ones kept for later requests (least recently used
        first out), and forget its keys."""
        self.cache.free(seq_id, keep=self._num_indexed.pop(seq_id, 0))
        self._keys.pop(seq_id, None)
