"""CompressedAttentionManager: vLLM allocates by physical length and takes evicted tails back.

Unit tests drive one manager over a real BlockPool; the engine test checks
that vLLM's registry and coordinator really give a compressing engine's KV
cache groups this manager (the engine core runs in this process, as in
test_block_accounting, so its scheduler can be read).
"""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, engine_kwargs, in_process_engine, random_prompts
from vllm_kvcompress.schedule import cdiv

NUM_BLOCKS = 20  # block 0 is vLLM's null block: 19 usable


@pytest.fixture
def spec():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvcompress.vllm_seam.block_manager import compressed_spec

    return compressed_spec(FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16,
                                             dtype=torch.float32))


@pytest.fixture
def manager(spec):
    from vllm.v1.core.block_pool import BlockPool

    from vllm_kvcompress.vllm_seam.block_manager import CompressedAttentionManager

    pool = BlockPool(num_gpu_blocks=NUM_BLOCKS, enable_caching=False, hash_block_size=BLOCK_SIZE)
    return CompressedAttentionManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                                      scheduler_block_size=BLOCK_SIZE)


def allocate(manager, rid: str, num_tokens: int, **kwargs) -> int:
    """What vLLM's coordinator does for one group: ask, then allocate."""
    need = manager.get_num_blocks_to_allocate(rid, num_tokens, [], 0, 0, num_tokens, **kwargs)
    manager.allocate_new_blocks(rid, num_tokens, num_tokens)
    return need


def test_spec_keeps_full_attention_fields_and_layout(spec):
    import dataclasses
    import pickle

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvcompress.vllm_seam.block_manager import CompressedAttentionSpec

    full = FullAttentionSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
    assert isinstance(spec, CompressedAttentionSpec) and isinstance(spec, FullAttentionSpec)
    assert spec.page_size_bytes == full.page_size_bytes
    assert pickle.loads(pickle.dumps(spec)) == spec  # the workers get it pickled
    assert spec.merge([spec, spec]) == spec


def test_registry_picks_the_manager_and_keeps_builtins(spec, monkeypatch):
    from vllm.v1 import kv_cache_spec_registry
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from vllm_kvcompress.vllm_seam.block_manager import CompressedAttentionManager, register_compressed_spec

    # As in a fresh process: vLLM registers its built-ins only into an empty registry.
    monkeypatch.setattr(kv_cache_spec_registry, "_REGISTRY_KVCACHESPEC_LIST", {})
    monkeypatch.setattr(kv_cache_spec_registry, "_REGISTRY_ROLE_MANAGERS", {})
    register_compressed_spec()
    register_compressed_spec()  # idempotent
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=spec.dtype)
    assert KVCacheSpecRegistry.get_manager_class(full) is FullAttentionManager
    assert KVCacheSpecRegistry.get_manager_class(spec) is CompressedAttentionManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(spec) is FullAttentionSpec


def evict_tail(manager, rid: str, logical_len: int, physical_len: int) -> tuple[int, int]:
    """An in-place compaction (nothing protected, nothing cached): (blocks freed, blocks held)."""
    assert manager.copies_needed(rid, physical_len, 0) == 0
    released = manager.release_evicted(rid, logical_len, physical_len, 0, copy=False)
    assert released.copy is None
    return released.freed, released.held


def test_shared_blocks_are_copied_not_rewritten(manager):
    """Blocks another request holds too (a prefix-cache hit) are never rewritten:
    the compaction gets fresh blocks for everything from the protected
    start's block on, and the originals lose only this request's reference."""
    pool = manager.block_pool
    allocate(manager, "a", 200)  # 7 blocks
    blocks = list(manager.req_to_blocks["a"])
    pool.touch(blocks[:5])  # another request shares the first 5
    protected = 2 * BLOCK_SIZE  # its first 2 blocks are a hit: kept whole
    free = pool.get_num_free_blocks()
    need = manager.copies_needed("a", 130, protected)
    assert need == cdiv(130, BLOCK_SIZE) - 2  # blocks 2..4 rewritten -> 3 fresh ones
    released = manager.release_evicted("a", 200, 130, protected, copy=True)
    freed, held, first, fresh = released.freed, released.held, released.copy.first_block, released.copy.fresh_blocks
    assert first == 2 and len(fresh) == need
    assert manager.req_to_blocks["a"][:2] == blocks[:2]  # the protected start stays
    assert [b.block_id for b in manager.req_to_blocks["a"][2:]] == list(fresh)
    assert not {b.block_id for b in blocks} & set(fresh)
    assert all(b.ref_cnt == 1 for b in blocks[2:5]) and all(b.ref_cnt == 0 for b in blocks[5:])
    assert (freed, held) == (2, 5) and pool.get_num_free_blocks() == free - need + 2
    # No room to copy shared blocks: the compaction must wait.
    allocate(manager, "b", (pool.get_num_free_blocks()) * BLOCK_SIZE)
    pool.touch(manager.req_to_blocks["a"][2:])
    assert manager.copies_needed("a", 90, protected) is None


def test_allocation_counts_physical_tokens(manager):
    pool = manager.block_pool
    free = pool.get_num_free_blocks()
    assert allocate(manager, "a", 300) == cdiv(300, BLOCK_SIZE)
    assert pool.get_num_free_blocks() == free - cdiv(300, BLOCK_SIZE)

    freed, held = evict_tail(manager, "a", logical_len=300, physical_len=64)
    assert (freed, held) == (cdiv(300, BLOCK_SIZE) - 2, 2)
    assert pool.get_num_free_blocks() == free - 2
    assert manager.num_evicted["a"] == 236

    # Token 301 (logical) is token 65 (physical): one more block, not none.
    assert allocate(manager, "a", 301) == 1
    assert len(manager.req_to_blocks["a"]) == 3
    assert pool.get_num_free_blocks() == free - 3
    # Up to physical 96 the third block has room.
    assert allocate(manager, "a", 332) == 0
    assert len(manager.req_to_blocks["a"]) == 3


def test_evict_tail_frees_exactly_the_tail(manager):
    pool = manager.block_pool
    allocate(manager, "a", 200)  # 7 blocks
    blocks = list(manager.req_to_blocks["a"])
    free = pool.get_num_free_blocks()
    assert evict_tail(manager, "a", 200, 70) == (4, 3)
    assert manager.req_to_blocks["a"] == blocks[:3]
    assert pool.get_num_free_blocks() == free + 4
    assert all(b.ref_cnt == 0 for b in blocks[3:]) and all(b.ref_cnt == 1 for b in blocks[:3])
    # A second eviction counts from the logical length again.
    allocate(manager, "a", 230)  # physical 100: 4 blocks
    assert evict_tail(manager, "a", 230, 40) == (2, 2)
    assert manager.num_evicted["a"] == 190


def test_admission_cap_only_when_asked(manager):
    manager.set_admission_cap("s", 96)
    assert allocate_count(manager, "s", 600, apply_admission_cap=True) == 3
    assert allocate_count(manager, "s", 600) == cdiv(600, BLOCK_SIZE)
    manager.set_admission_cap("s", None)
    assert allocate_count(manager, "s", 600, apply_admission_cap=True) == cdiv(600, BLOCK_SIZE)


def allocate_count(manager, rid: str, num_tokens: int, **kwargs) -> int:
    return manager.get_num_blocks_to_allocate(rid, num_tokens, [], 0, 0, num_tokens, **kwargs)


def test_free_returns_everything_and_forgets_the_request(manager):
    pool = manager.block_pool
    free = pool.get_num_free_blocks()
    allocate(manager, "a", 300)
    evict_tail(manager, "a", 300, 64)
    manager.set_admission_cap("a", 96)
    allocate(manager, "a", 400)
    manager.free("a")
    assert pool.get_num_free_blocks() == free
    assert "a" not in manager.num_evicted and "a" not in manager.max_tokens
    assert "a" not in manager.req_to_blocks
    # Preempted and resumed: a fresh, logical-length start.
    assert allocate(manager, "a", 300) == cdiv(300, BLOCK_SIZE)


# ------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def engine(tiny_model):
    with in_process_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=2)) as engine:
        yield engine


def test_engine_groups_get_the_compressed_manager(engine):
    from vllm import SamplingParams

    from vllm_kvcompress.vllm_seam.block_manager import CompressedAttentionManager, CompressedAttentionSpec

    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler
    groups = scheduler.kv_cache_config.kv_cache_groups
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert len(groups) == len(managers) == 2
    assert all(type(g.kv_cache_spec) is CompressedAttentionSpec for g in groups)
    assert all(type(m) is CompressedAttentionManager for m in managers)

    core = engine.llm.llm_engine
    (prompt,) = random_prompts((300,), seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            extra_args={"kv_compress": {"policy": "snapkv", "budget": 64}})
    core.add_request("bm", {"prompt_token_ids": prompt}, params)
    core.step()  # prefill
    core.step()  # compress to 64 tokens, decode one
    (rid,) = [r for r in managers[0].req_to_blocks if r.startswith("bm")]
    for m in managers:
        assert m.num_evicted[rid] == 300 - 64
        assert len(m.req_to_blocks[rid]) == cdiv(65, BLOCK_SIZE)
    while core.has_unfinished_requests():
        core.step()
    for m in managers:
        assert rid not in m.num_evicted and rid not in m.max_tokens and rid not in m.req_to_blocks
