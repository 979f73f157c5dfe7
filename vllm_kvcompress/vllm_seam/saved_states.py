"""Compressed states kept in vLLM's prefix cache for later requests (`reuse`).

When a compressed request with `reuse` finishes, its blocks hold the
compressed KV of its whole history (prompt and outputs, but the last output,
whose KV was never computed). Instead of returning them as plain free blocks,
the scheduler names each of them with a key of its own in vLLM's block pool
(beside vLLM's own hash, where the block has one) before they are freed: they
go to the end of vLLM's free queue like any cached block, and vLLM evicts
them, least recently used first, when it needs room, which drops the key.

A later request whose prompt begins with exactly that history, under the same
compression settings, starts from the state: its first blocks are the saved
ones (shared, read-only: vLLM copies a shared partly filled last block, and a
compaction copies whatever it would rewrite), its computed tokens are the
history's, and the workers continue the saved token state (positions, scores)
instead of computing the history again.

On a hybrid model the groups that do not compress (sliding-window layers)
are saved beside the compressed ones: a sliding-window group's blocks of the
state's last window, named the same way (the blocks before it are vLLM's
null block, as in any sliding-window hit). They hold keys computed from the
compressed layers before them, as the state's next token reads them, so
vLLM's own hashes never name them (block_manager.cache_exact_tokens_only).

A state is found only by an exact match: the settings' fingerprint, vLLM's
hash of the history's last full block (a chain over every earlier block that
folds in `cache_salt`, LoRA and multimodal inputs), and the history's tokens
themselves. It is used only if every block still carries its key: a state
that lost one is dropped whole, never used in part.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id

# A key is 33 bytes (a marker and a sha256): never one of vLLM's 32-byte hashes.
_MARKER = b"K"


@dataclass(frozen=True)
class SavedState:
    """One finished request's compressed state, as the scheduler keeps it."""

    key: str  # what the workers keep its token state under
    fingerprint: str  # the compression settings it was made with
    history: tuple[int, ...]  # the tokens whose KV it holds, in logical order
    anchor: bytes  # vLLM's hash of the history's last full block
    physical: tuple[int, ...]  # slots it holds per compressed KV cache group
    in_place: int  # its first tokens that sit at their own slots (the protected start)
    # Per KV cache group, every group in vLLM's order (a sliding-window
    # group's blocks before its window: the null block).
    blocks: tuple[tuple[KVCacheBlock, ...], ...]
    keys: tuple[tuple[bytes | None, ...], ...]  # each block's key in the pool (None: the null block)

    @property
    def length(self) -> int:
        return len(self.history)

    def num_evicted(self) -> tuple[int, ...]:
        return tuple(self.length - p for p in self.physical)

    def all_blocks(self) -> list[KVCacheBlock]:
        """The blocks it holds (not the null block)."""
        return [b for group in self.blocks for b in group if not b.is_null]


class SavedStates:
    """The scheduler's saved states, found by their history's last full block."""

    def __init__(self, pool: BlockPool, block_size: int, num_groups: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_groups = num_groups  # vLLM's KV cache groups, compressed or not
        self.states: dict[str, SavedState] = {}
        self._by_anchor: dict[tuple[str, bytes], list[str]] = {}
        self._sweep: list[str] = []  # keys still to check in the current round

    def save(self, fingerprint: str, history: Sequence[int], anchor: bytes, physical: tuple[int, ...],
             in_place: int, blocks: Sequence[Sequence[KVCacheBlock]]) -> SavedState | None:
        """Name a finishing request's blocks in the pool (before they are
        freed) and keep its state; None where an equal state is kept already."""
        key = hashlib.sha256(repr((fingerprint, anchor, tuple(history), physical)).encode()).hexdigest()
        if key in self.states and self.valid(self.states[key]):
            return None
        assert len(blocks) == self.num_groups
        block_keys = []
        for g, group_blocks in enumerate(blocks):
            names: list[bytes | None] = []
            for i, block in enumerate(group_blocks):
                if block.is_null:
                    names.append(None)
                    continue
                name = make_block_hash_with_group_id(_MARKER + hashlib.sha256(f"{key}:{g}:{i}".encode()).digest(), g)
                self.pool._insert_block_hash(name, block, None)
                names.append(name)
            block_keys.append(tuple(names))
        state = SavedState(key, fingerprint, tuple(history), anchor, physical, in_place,
                           tuple(tuple(b) for b in blocks), tuple(block_keys))
        self.states[key] = state
        self._by_anchor.setdefault((fingerprint, anchor), []).append(key)
        return state

    def valid(self, state: SavedState) -> bool:
        """Whether every block still carries its key (none was reused since)."""
        cached = self.pool.cached_block_hash_to_block
        return all(name is None or cached.contain(name, block.block_id)
                   for names, blocks in zip(state.keys, state.blocks) for name, block in zip(names, blocks))

    def find(self, fingerprint: str, tokens: Sequence[int], block_hashes: Sequence[bytes], in_place: int,
             dropped: list[str]) -> SavedState | None:
        """The longest valid state whose history begins `tokens` and leaves at
        least one of them to compute; states found invalid on the way are
        dropped (their keys added to `dropped`)."""
        bs = self.block_size
        for i in range(min(len(block_hashes), (len(tokens) - 1) // bs) - 1, -1, -1):
            best = None
            for key in self._by_anchor.get((fingerprint, block_hashes[i]), ()):
                state = self.states[key]
                n = state.length
                if n < len(tokens) and n // bs == i + 1 and state.in_place >= in_place \
                        and (best is None or n > best.length) and tuple(tokens[:n]) == state.history:
                    best = state
            if best is not None:
                if self.valid(best):
                    return best
                self.drop(best.key)
                dropped.append(best.key)
                return self.find(fingerprint, tokens, block_hashes, in_place, dropped)
        return None

    def get(self, key: str) -> SavedState | None:
        return self.states.get(key)

    def drop(self, key: str) -> None:
        state = self.states.pop(key, None)
        if state is not None:
            keys = self._by_anchor[(state.fingerprint, state.anchor)]
            keys.remove(key)
            if not keys:
                del self._by_anchor[(state.fingerprint, state.anchor)]

    def sweep(self, pinned: set[str], most: int) -> list[str]:
        """Check up to `most` states, round-robin, and drop those that lost a
        block (not `pinned` ones: their blocks are held): the workers then drop
        their token state too. Amortised, so that a step never checks them all."""
        dropped = []
        for _ in range(min(most, len(self.states))):
            if not self._sweep:
                self._sweep = list(self.states)
            key = self._sweep.pop()
            state = self.states.get(key)
            if state is not None and key not in pinned and not self.valid(state):
                self.drop(key)
                dropped.append(key)
        return dropped
