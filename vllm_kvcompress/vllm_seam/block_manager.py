"""Block accounting of compressed requests, as a vLLM KV cache spec and manager.

vLLM's KV cache managers size a request's block table by its *logical* length
(every token it has seen). A compressed request holds fewer cache slots than
that, so its KV cache groups carry `CompressedAttentionSpec`, and vLLM's
coordinator builds a `CompressedAttentionManager` for each such group: it
allocates by the *physical* length and hands evicted tails back to the pool.

The spec goes through vLLM's own extension point, `KVCacheSpecRegistry`, so
nothing of vLLM's is patched for it. The engine core's `get_kv_cache_groups`
wrapper (groups.py) puts the spec into the KV cache config; the workers get
it with that config and lay out tensors exactly as for `FullAttentionSpec`.

Prefix caching. vLLM hashes a request's full blocks as they fill, and other
requests may then share them. A compaction never writes into such a block:
the blocks it would rewrite (from the protected start's block on) are
replaced by fresh ones that receive the kept tokens (copy on write), and the
originals go back to the pool still cached, so a later request with the same
prefix hits them intact. Once a request has compacted, its blocks past the
protected start hold tokens out of logical order, and are never cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ..schedule import cdiv
from ..step_records import BlockCopy


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressedAttentionSpec(FullAttentionSpec):
    """A full-attention group whose requests may hold fewer slots than tokens.

    The cache layout is FullAttentionSpec's: only the manager differs. The
    class is registered with `uniform_type_base_spec=FullAttentionSpec`, and
    every check vLLM makes on it is `isinstance(..., FullAttentionSpec)`.
    """


def compressed_spec(spec: FullAttentionSpec) -> CompressedAttentionSpec:
    """The same group, managed by CompressedAttentionManager: every init field
    copied as it is, whichever fields this vLLM's spec has (read from the
    instance's dict, not as attributes the seam relies on by name)."""
    fields = vars(spec)
    return CompressedAttentionSpec(**{f.name: fields[f.name] for f in dataclasses.fields(spec) if f.init})


@dataclass(frozen=True)
class ReleasedBlocks:
    """What a compaction did to one KV cache group's blocks."""

    freed: int  # blocks returned to the pool
    held: int  # blocks the request holds after it
    copy: BlockCopy | None  # the fresh blocks that receive the kept tokens (None: compacted in place)


# vLLM's own methods, called directly from the overrides below (the class's
# only base): each runs per request per step, where super()'s lookup and
# keyword passing are a measurable share.
_vllm_blocks_to_allocate = FullAttentionManager.get_num_blocks_to_allocate
_vllm_allocate_new_blocks = FullAttentionManager.allocate_new_blocks


class CompressedAttentionManager(FullAttentionManager):
    """FullAttentionManager that allocates by physical length and frees evicted tails.

    Exists because vLLM sizes block tables by logical length (every token a
    request has seen): after an eviction, each new token would get a slot
    past the ones the request really holds, and the freed tail would be
    allocated again at once. One instance per KV cache group; the scheduler
    (KVCompressScheduler) tells it, per request, how many tokens were evicted
    from this group and how many a streamed prompt ever holds.

    With prefix caching on, compaction copies into fresh blocks whatever
    it would otherwise rewrite of a cached or shared block (`compact`).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Tokens of the request that may still be cached: its blocks from the
        # first rewritten one on hold tokens out of logical order.
        self.cacheable: dict[str, int] = {}
        # Logical - physical tokens per request, in this group.
        self.num_evicted: dict[str, int] = {}
        # Most tokens a streamed prompt ever holds: vLLM admits a waiting
        # request only if its whole prompt fits, which a streamed prompt never
        # needs (as vLLM caps sliding-window requests at their window).
        self.max_tokens: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        # Called per request per step: the physical lengths are worked out
        # inline (a helper's frame here is a measurable share of a step).
        evicted = self.num_evicted.get(request_id, 0)
        num_tokens, num_tokens_main_model = num_tokens - evicted, num_tokens_main_model - evicted
        if evicted and new_computed_blocks:  # it starts from a saved state: its hit is physical too
            total_computed_tokens, num_local_computed_tokens = (total_computed_tokens - evicted,
                                                                num_local_computed_tokens - evicted)
        cap = self.max_tokens.get(request_id) if apply_admission_cap else None
        if cap is not None:
            num_tokens, num_tokens_main_model = min(num_tokens, cap), min(num_tokens_main_model, cap)
        return _vllm_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                        num_local_computed_tokens, num_tokens_main_model, apply_admission_cap,
                                        prefill_end)

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        # A request starting from a saved compressed state (`reuse`): its hit
        # is the state's blocks, physical; a partly filled last one is copied
        # by vLLM before the request writes into it (its partial-hit copy on write).
        evicted = self.num_evicted.get(request_id, 0)
        super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens - evicted,
                                          num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[KVCacheBlock]:
        # Never capped: vLLM allocates only for the tokens it schedules, and a
        # streamed prompt's chunks end where its evictions are due.
        evicted = self.num_evicted.get(request_id, 0)
        return _vllm_allocate_new_blocks(self, request_id, num_tokens - evicted, num_tokens_main_model - evicted)

    def copies_needed(self, request_id: str, physical_len: int, protected_len: int) -> int | None:
        """Fresh blocks a compaction to `physical_len` needs (0: it rewrites in place).

        The blocks it would rewrite run from the protected start's block to
        the new length's; if one of them is cached or shared, all of them are
        copied. None: one is shared and the pool has too few free blocks to
        copy (the compaction must wait).
        """
        rewritten = self._rewritten(request_id, physical_len, protected_len)
        if all(self.block_pool.is_block_writable(b) for b in rewritten):
            return 0
        if len(rewritten) <= self.block_pool.get_num_free_blocks():
            return len(rewritten)
        if any(b.ref_cnt > 1 for b in rewritten):
            return None
        return 0  # only cached, not shared: `release_evicted` drops their hashes, the worker rewrites them

    def _rewritten(self, request_id: str, physical_len: int, protected_len: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(request_id, [])
        return blocks[protected_len // self.block_size: cdiv(physical_len, self.block_size)]

    def release_evicted(self, request_id: str, logical_len: int, physical_len: int, protected_len: int,
                        copy: bool, to_free: list[KVCacheBlock] | None = None) -> ReleasedBlocks:
        """Keep the blocks of `physical_len` tokens, give the rest back to the pool.

        `copy` (`copies_needed` > 0): the blocks from the protected start's on
        are replaced by fresh ones, which the worker fills with the kept
        tokens; the originals are released (cached ones stay in the prefix
        cache). Otherwise the kept tokens are compacted in place into the
        leading blocks, before the step writes anything, so the tail may go
        to another request this very step.

        `to_free`: released blocks go there instead of to the pool, for the
        caller to free once every compaction of the step has its fresh
        blocks. The worker reads a compaction's originals while it writes
        others' fresh blocks (layer by layer, and the layers of all KV cache
        groups share the pool's block ids): a block released in this step
        must not be another compaction's fresh block.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        first = protected_len // self.block_size
        keep = cdiv(physical_len, self.block_size)
        copied = None
        if copy:
            fresh = self.block_pool.get_new_blocks(keep - first)
            released = blocks[first:]
            blocks[first:] = fresh
            copied = BlockCopy(first, tuple(b.block_id for b in fresh))
        else:
            for block in self._rewritten(request_id, physical_len, protected_len):
                # Cached but not shared (copies_needed): its hash would name
                # tokens it no longer holds.
                drop_cached_hash(self.block_pool, block)
            released = blocks[keep:]
            del blocks[keep:]
        # Tail first, as vLLM's own free does: the most recent blocks are the
        # first to be reused.
        if to_free is None:
            self.block_pool.free_blocks(reversed(released))
        else:
            to_free.extend(reversed(released))
        self.num_evicted[request_id] = logical_len - physical_len
        self.cacheable[request_id] = first * self.block_size  # the protected start is fixed per request
        return ReleasedBlocks(freed=len(released) - (0 if copied is None else len(copied.fresh_blocks)),
                              held=len(blocks), copy=copied)

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        limit = self.cacheable.get(request.request_id)
        super().cache_blocks(request, num_tokens if limit is None else min(num_tokens, limit), *args, **kwargs)

    def set_admission_cap(self, request_id: str, max_tokens: int | None) -> None:
        if max_tokens is None:
            self.max_tokens.pop(request_id, None)
        else:
            self.max_tokens[request_id] = max_tokens

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        # `free` (finish, abort, preemption) and the scheduler's deferred free
        # both come here: the request's cache is gone, and a resumed request
        # prefills again from a full-length, uncompressed start.
        self.num_evicted.pop(request_id, None)
        self.max_tokens.pop(request_id, None)
        self.cacheable.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def cache_exact_tokens_only(manager, exact_until: dict[str, int]) -> None:
    """A KV cache group that does not compress (a hybrid's sliding-window
    layers, a Gated DeltaNet state) caches a request's blocks under vLLM's
    own hashes, which name tokens alone. Its tokens computed from the
    request's first compaction on (or from a saved state, `reuse`) read a
    compressed cache in the layers before them: their KV differs from what
    an uncompressed request computes for the same tokens, and a later request
    (compressed or not) must never hit it. `exact_until[request_id]`: the
    tokens the group may cache for that request (absent: all).

    Wraps the manager instance's `cache_blocks` (vLLM's coordinator calls it
    per group), whichever manager class vLLM picked for the group."""
    cache_blocks = manager.cache_blocks

    def cache_exact_blocks(request, num_tokens: int, *args, **kwargs) -> None:
        limit = exact_until.get(request.request_id)
        cache_blocks(request, num_tokens if limit is None else min(num_tokens, limit), *args, **kwargs)

    manager.cache_blocks = cache_exact_blocks


def drop_cached_hash(pool: BlockPool, block: KVCacheBlock) -> None:
    """Take a block out of the prefix cache (vLLM does this when it reuses a
    free block: `BlockPool._maybe_evict_cached_block`, 0.32)."""
    pool._maybe_evict_cached_block(block)


def register_compressed_spec(vllm_config=None) -> None:
    """Tell vLLM's registry which manager CompressedAttentionSpec groups get. Idempotent.

    The registry registers vLLM's built-in specs lazily, and only while it is
    empty (`KVCacheSpecRegistry._ensure_registered`): registering ours first
    would leave FullAttentionSpec and every other built-in unregistered, so
    the built-ins go in first.
    """
    KVCacheSpecRegistry._ensure_registered(vllm_config)
    KVCacheSpecRegistry.register(
        CompressedAttentionSpec, CompressedAttentionManager, uniform_type_base_spec=FullAttentionSpec)
