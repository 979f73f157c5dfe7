"""Growth-aware admission: a compressed request starts only if what the
running requests may still grow to, plus its own peak, fits the free blocks.

vLLM admits a waiting request when its prompt's blocks are free. A
compressed prompt shrinks right after prefill, so on prompts alone many are
admitted, then grow together (their outputs are kept) and preempt each
other. The scheduler (`KVCompressScheduler._admits`) follows the running
requests and the new one forward, a token a step, each growing until its
`max_tokens` and then giving its blocks back, and admits only if they fit at
every step. Here a tight pool (20 blocks of 32
tokens) and engines whose core runs in this process, stepped one scheduler
step at a time: the invariant "the running requests' growth until each ends
fits the blocks they hold plus the free ones" holds at every step with the rule, and is broken without it
(`reserve_growth` 0: vLLM's admission on the compressed prompt); vanilla
requests are scheduled step for step as by vLLM without the plugin; answers
equal the reference decoder.
"""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.schedule import RequestSchedule, cdiv

NUM_BLOCKS = 20  # 19 usable (one is vLLM's null block)
MAX_LEN = 512  # vLLM checks at startup that one request of max_model_len fits
BUDGET = 48
COMPRESSED = {"policy": "snapkv", "budget": BUDGET, "window": 8}
NEW_TOKENS = 64
# 7 blocks each while prefilling, 4 once compressed and grown (9 uncompressed)
PROMPT_LENS = [200 + 5 * i for i in range(6)]


def params(max_tokens: int, config: dict | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          extra_args=None if config is None else {"kv_compress": config})


def scheduler_of(engine):
    return engine.llm.llm_engine.engine_core.engine_core.scheduler


def overdrawn_by(sched) -> int:
    """How far the running requests' blocks, followed forward a token a step
    until each ends, exceed at worst the blocks they hold plus the free ones
    (<= 0: they fit), computed here from their lengths alone: a compressed
    snapkv request holds the budget plus every output, up to prompt +
    max_tokens, then gives its blocks back."""
    (manager,) = sched.kv_cache_manager.coordinator.single_type_managers
    capacity = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    lines = []
    for r in sched.running:
        capacity += len(manager.req_to_blocks.get(r.request_id, ()))
        prompt = r.num_prompt_tokens
        assert r.num_computed_tokens >= prompt  # whole prompts, prefilled in one step
        lines.append((prompt, r.num_tokens, prompt + r.max_tokens))

    def held(step: int) -> int:
        return sum(cdiv(min(BUDGET, prompt) + start + step - prompt, BLOCK_SIZE)
                   for prompt, start, final in lines if start + step <= final)

    return max(held(t) for t in [0] + [final - start for _, start, final in lines]) - capacity

def run_stepped(engine, prompts, configs, max_tokens) -> dict:
    """Add the requests, step until done; per step: the scheduled requests,
    preemptions, running count, and whether the reservation fitted."""
    core = engine.llm.llm_engine
    sched = scheduler_of(engine)
    preempt = sched._preempt_request
    preempted: list[str] = []

    def counted(request, *a, **k):
        preempted.append(request.request_id.split("-")[0])
        return preempt(request, *a, **k)

    schedule = sched.schedule
    steps: list[tuple] = []

    def recorded(*a, **k):
        out = schedule(*a, **k)
        steps.append(tuple(sorted((rid.split("-")[0], n) for rid, n in out.num_scheduled_tokens.items())))
        return out

    sched._preempt_request, sched.schedule = counted, recorded
    try:
        for i, (prompt, config) in enumerate(zip(prompts, configs)):
            core.add_request(f"q{i}", {"prompt_token_ids": prompt}, params(max_tokens, config))
        outputs: dict[str, list[int]] = {}
        overdrawn, running = [], []
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    outputs[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)
            running.append(len(sched.running))
            overdrawn.append(overdrawn_by(sched))
    finally:
        del sched._preempt_request, sched.schedule  # the class's methods again
    return {"steps": steps, "preempted": preempted, "running": running, "overdrawn": overdrawn,
            "outputs": [outputs[f"q{i}"] for i in range(len(prompts))]}


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    # Engines in one process share vLLM's global state: all are closed at the module's end.
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", num_gpu_blocks_override=NUM_BLOCKS,
                                        max_model_len=MAX_LEN))


def test_admission_reserves_the_growth_of_compressed_requests(engine, reference):
    prompts = random_prompts(PROMPT_LENS, seed=41)
    got = run_stepped(engine, prompts, [COMPRESSED] * len(prompts), NEW_TOKENS)
    # At every step the running requests' growth fits, counting the blocks
    # each gives back when it ends...
    assert max(got["overdrawn"]) <= 0, got["overdrawn"]
    assert got["preempted"] == []
    # ... and compression still buys concurrency: uncompressed, 2 of these
    # (9 blocks each at the end) fit the 19 blocks.
    assert max(got["running"]) >= 4, got["running"]
    assert engine.stats()["free_blocks"] == engine.stats()["total_blocks"]
    cfg = KVCompressConfig.from_dict(COMPRESSED)
    for prompt, tokens in zip(prompts, got["outputs"]):
        assert tokens == reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)["tokens"]


def test_without_the_reservation_the_pool_is_overdrawn(start_engine, tiny_model, reference):
    """reserve_growth 0: vLLM's admission on the compressed prompt admits
    requests whose growth does not fit, and they preempt each other (the
    invariant above fails); answers stay exact."""
    loose = start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_reserve_growth=0,
                                         num_gpu_blocks_override=NUM_BLOCKS, max_model_len=MAX_LEN))
    prompts = random_prompts(PROMPT_LENS, seed=41)
    got = run_stepped(loose, prompts, [COMPRESSED] * len(prompts), NEW_TOKENS)
    assert max(got["overdrawn"]) > 0
    assert got["preempted"]
    cfg = KVCompressConfig.from_dict(COMPRESSED)
    for prompt, tokens in zip(prompts, got["outputs"]):
        assert tokens == reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)["tokens"]


def test_vanilla_requests_are_scheduled_as_by_vllm(start_engine, engine, tiny_model):
    """Uncompressed requests on the plugin's scheduler: the same requests
    scheduled at every step, the same preemptions and outputs as on vLLM's
    own scheduler (no kv_compress), on a workload that preempts."""
    prompts = random_prompts([200 + 13 * i for i in range(4)], seed=43)
    plugged = run_stepped(engine, prompts, [None] * len(prompts), 100)
    plain = start_engine(**engine_kwargs(tiny_model, num_gpu_blocks_override=NUM_BLOCKS, max_model_len=MAX_LEN))
    assert not hasattr(scheduler_of(plain), "kvc_states")  # vLLM's own scheduler
    vanilla = run_stepped(plain, prompts, [None] * len(prompts), 100)
    assert vanilla["preempted"], "the cache was meant to be too small"
    for key in ("steps", "preempted", "running", "outputs"):
        assert plugged[key] == vanilla[key], key


def test_peak_physical_follows_the_trigger():
    def state(config: dict, prompt_len: int) -> RequestSchedule:
        plan = resolve_plan(KVCompressConfig.from_dict(config), prompt_len, 2, BLOCK_SIZE)
        return RequestSchedule.create(plan, [0, 0])

    once = state(COMPRESSED, 300)
    assert once.peak_physical(0, 400) == (300,)  # the prompt, whole, before it is compressed
    assert once.peak_physical(0, 600) == (BUDGET + 300,)  # then the budget and every output
    rolling = state({"policy": "streamingllm", "budget": 48, "interval": 16}, 300)
    assert rolling.peak_physical(0, 1000) == (300,)
    rolling.commit(300, (48,))
    assert rolling.peak_physical(300, 1000) == (48 + 16,)  # the budget plus an interval
    assert rolling.peak_physical(300, 310) == (48 + 10,)  # ... or less, at the end
    assert state({"policy": "none"}, 300).peak_physical(0, 400) is None
    assert once.held_after_prompt(350) == (BUDGET + 50,)
    assert rolling.held_after_prompt(1000) == (48 + 16,)
    # once_window: the prompt's budget, then a window of outputs plus an interval.
    window = state({"policy": "snapkv-span-window", "budget": 48, "decode_window": 64, "interval": 16}, 300)
    assert window.peak_physical(0, 1000) == (300,)
    assert window.next_compression(300) == (48,)
    window.commit(300, (48,))
    assert window.peak_physical(300, 1000) == window.held_after_prompt(1000) == (48 + 64 + 16,)
    assert window.peak_physical(300, 340) == (48 + 40,)
    held = []
    for logical in range(301, 1000):  # the schedule the forecast describes
        held.append(window.physical(logical)[0])
        targets = window.next_compression(logical)
        if targets is not None:
            assert targets == (48 + 64,)
            window.commit(logical, targets)
    assert max(held) == 48 + 64 + 16
