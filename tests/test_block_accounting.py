"""Evicted tokens' blocks go back to vLLM's pool, and nothing leaks.

A deliberately small KV cache (40 blocks of 32 tokens) so that long
uncompressed requests force preemption. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that `step()` is exactly one scheduler
step and the pool can be read between steps; requests are driven step by step
so some can be aborted mid-flight.
"""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, engine_kwargs, in_process_engine, random_prompts
from vllm_kvcompress.schedule import cdiv

NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def engine(tiny_model):
    with in_process_engine(**engine_kwargs(tiny_model, kv_compress="none", num_gpu_blocks_override=NUM_BLOCKS)) as e:
        yield e


def params(max_tokens: int, config: dict | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          extra_args=None if config is None else {"kv_compress": config})


def request_stats(engine, request_id: str) -> dict:
    """Stats of a request by the id given to add_request (vLLM appends a suffix)."""
    matches = [v for k, v in engine.stats()["requests"].items() if k.split("-")[0] == request_id]
    assert len(matches) == 1, engine.stats()["requests"].keys()
    return matches[0]


@pytest.mark.mrv2
def test_blocks_return_to_pool_mid_request(engine):
    core = engine.llm.llm_engine
    start = engine.stats()
    assert start["free_blocks"] == start["total_blocks"]
    (prompt,) = random_prompts((300,), seed=11)
    core.add_request("midreq", {"prompt_token_ids": prompt}, params(8, {"policy": "snapkv", "budget": 64}))
    core.step()  # prefill: 300 tokens in 10 blocks
    after_prefill = engine.stats()["free_blocks"]
    assert after_prefill == start["free_blocks"] - cdiv(300, BLOCK_SIZE)
    core.step()  # compress to 64 tokens (2 blocks) and decode one token (3rd block)
    after_compress = engine.stats()["free_blocks"]
    assert after_compress == start["free_blocks"] - cdiv(65, BLOCK_SIZE)
    while core.has_unfinished_requests():
        core.step()
    stats = request_stats(engine, "midreq")
    assert stats["tokens_evicted"] == 300 - 64
    assert stats["blocks_freed"] == cdiv(300, BLOCK_SIZE) - cdiv(64, BLOCK_SIZE)
    assert engine.stats()["free_blocks"] == start["free_blocks"]


@pytest.mark.mrv2
def test_no_leak_with_preemption_and_aborts(engine):
    core = engine.llm.llm_engine
    start = engine.stats()
    prompts = random_prompts((200, 230, 180, 260, 210, 190, 240, 220, 250), seed=5)
    configs = [None, None, None, None,
               {"policy": "h2o", "budget": 64}, {"policy": "snapkv", "budget": 64},
               {"policy": "streamingllm", "budget": 48}, {"policy": "tova", "budget": 64},
               {"policy": "adakv", "budget": 64}]  # its lengths come back from the worker
    max_tokens = 260
    for i, (prompt, config) in enumerate(zip(prompts, configs)):
        core.add_request(f"r{i}", {"prompt_token_ids": prompt}, params(max_tokens, config))
    # Abort an uncompressed and a compressed request at different points.
    abort_at = {5: "r1", 40: "r5"}
    finished: dict[str, int] = {}
    step = 0
    while core.has_unfinished_requests():
        if step in abort_at:
            core.abort_request([abort_at[step]])
        for out in core.step():
            if out.finished:
                finished[out.request_id.split("-")[0]] = len(out.outputs[0].token_ids)
        step += 1
    end = engine.stats()
    assert end["preemptions"] > start["preemptions"], "the cache was meant to be too small"
    assert end["free_blocks"] == end["total_blocks"] == start["free_blocks"]
    for rid in {f"r{i}" for i in range(len(prompts))} - set(abort_at.values()):
        assert finished.get(rid) == max_tokens, rid


def test_8x_compressed_request_holds_an_eighth_of_the_blocks(engine):
    (prompt,) = random_prompts((512,), seed=13)
    new_tokens = 16
    engine.generate([prompt], new_tokens, [None])
    engine.generate([prompt], new_tokens, [{"policy": "snapkv", "compression_ratio": 0.875}])
    finished = [v for v in engine.stats()["requests"].values() if v["finished"] and v["prefill_len"] == 512]
    plain, squeezed = finished[-2], finished[-1]
    assert plain["tokens_evicted"] == 0 and squeezed["tokens_kept"] == 64
    assert plain["blocks_held"] == cdiv(512 + new_tokens - 1, BLOCK_SIZE)
    assert squeezed["blocks_held"] <= plain["blocks_held"] / 8 + 1


def test_streamed_prompt_never_holds_more_than_budget_plus_chunk(engine):
    """StreamingLLM with prompt_chunk: admission and prefill need only
    budget + chunk tokens of cache, not the whole prompt."""
    core = engine.llm.llm_engine
    start = engine.stats()["free_blocks"]
    (prompt,) = random_prompts((900,), seed=17)
    budget, chunk = 64, 64
    config = {"policy": "streamingllm", "budget": budget, "prompt_chunk": chunk}
    core.add_request("streamed", {"prompt_token_ids": prompt}, params(40, config))
    held, steps = [], 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        held.append(start - engine.stats()["free_blocks"])
    assert max(held) == cdiv(budget + chunk, BLOCK_SIZE)  # 4 blocks; unstreamed: cdiv(900, 32) = 29
    assert steps >= (900 - budget) // chunk + 40  # the prompt went in budget + chunk, then chunk-sized steps
    stats = request_stats(engine, "streamed")
    # 900 - 64 prompt tokens evicted 64 at a time, the last partial chunk at prefill end.
    assert stats["compressions"] >= cdiv(900 - budget - chunk, chunk) + 1
    assert stats["tokens_evicted"] >= 900 - budget
    assert engine.stats()["free_blocks"] == start


def test_streamed_prompts_are_admitted_on_what_they_hold(engine):
    """vLLM admits a request only when its whole prompt fits in the free blocks;
    a streamed prompt is admitted on budget + chunk instead."""
    core = engine.llm.llm_engine
    scheduler = core.engine_core.engine_core.scheduler
    start = engine.stats()["free_blocks"]
    prompts = random_prompts((900,) * 5, seed=19)  # 29 blocks each, 39 usable
    config = {"policy": "streamingllm", "budget": 64, "prompt_chunk": 64}
    for i, prompt in enumerate(prompts):
        core.add_request(f"adm{i}", {"prompt_token_ids": prompt}, params(8, config))
    core.step()
    # Each holds 4 blocks; admitting on the whole prompt (29 blocks) would stop
    # at 3, once fewer than 29 of the 39 blocks are free.
    assert len(scheduler.running) == 5
    while core.has_unfinished_requests():
        core.step()
    assert engine.stats()["free_blocks"] == start
