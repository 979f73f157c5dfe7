"""The scheduler's per-step shortcuts give what the rules computed afresh give.

At hundreds of running requests the scheduler looks at a request only where
something about it may have changed (issue 52): a request below its
`quiet_below` has nothing due, a running request is looked at only if its
length reached it (or it was reset), and its next compression point
(`next_due`, what the workers observe up to) stays as last sent. Here a real engine, its
core in this process, runs a batch of requests with every kind of trigger
(compress once, rolling, decode, a streamed prompt, layer budgets reported
from the prompt's attention) in a pool tight enough to preempt, and after
every step checks, for every scheduled request with a plan:

- the next_due its workers hold equals `RequestSchedule.next_due` computed
  afresh from its length;
- no running request the step skipped (not in `_kvc_may_be_due`) had a
  compression due.
"""

from __future__ import annotations

import pytest

from helpers import engine_kwargs, in_process_engine, random_prompts

SETTINGS = [
    {"policy": "snapkv", "budget": 64, "window": 8},
    {"policy": "snapkv-span", "compression_ratio": 0.75},
    {"policy": "h2o", "budget": 48, "interval": 16},
    {"policy": "streamingllm", "budget": 40, "interval": 8},
    {"policy": "rkv", "budget": 64, "interval": 16},
    {"policy": "streamingllm", "budget": 48, "prompt_chunk": 64},
    {"policy": "snapkv-span-window", "budget": 64},
    {"policy": "pyramidkv", "budget": 64},
    {"policy": "adaptive", "budget": 64},
    None,  # uncompressed beside them
]


@pytest.mark.mrv2
def test_next_due_and_due_requests_match_the_rules_afresh(tiny_model):
    prompts = random_prompts([120 + 17 * i for i in range(2 * len(SETTINGS))], seed=3)
    overrides = [SETTINGS[i % len(SETTINGS)] for i in range(len(prompts))]
    # Two KV cache groups (per-layer budgets), 48 blocks of 32: the batch
    # does not fit uncompressed, and without growth-aware admission
    # (reserve_growth 0) some are preempted and resume.
    engine_config = {"policy": "snapkv", "budget": 64, "reserve_growth": 0}
    with in_process_engine(**engine_kwargs(tiny_model, num_gpu_blocks_override=48, max_num_seqs=12,
                                           max_model_len=512, max_num_batched_tokens=64,
                                           kv_compress_layer_groups=2, kv_compress=engine_config)) as engine:
        sched = engine.llm.llm_engine.engine_core.engine_core.scheduler
        checked = {"next_due": 0, "skipped": 0}
        next_due_changes = sched._next_due_changes
        plan_compressions = sched._plan_compressions

        def checked_next_due(scheduled):
            changes = next_due_changes(scheduled)
            for rid, n in scheduled.items():
                state = sched.kvc_states.get(rid)
                if state is None or state.plan is None:
                    continue
                fresh = state.next_due(sched.requests[rid].num_computed_tokens - n)
                assert sched._kvc_due_sent[rid] == fresh, (rid, sched._kvc_due_sent[rid], fresh)
                checked["next_due"] += 1
            return changes

        def checked_plan_compressions():
            looked_at = set(sched._kvc_may_be_due)
            quiet = [r for r in sched.running if r.request_id not in looked_at]
            ops = plan_compressions()
            for r in quiet:  # skipped: a fresh look finds nothing due
                state = sched.kvc_states.get(r.request_id)
                if state is not None:
                    saved = state.quiet_below
                    state.quiet_below = 0
                    assert state.next_compression(r.num_computed_tokens) is None, r.request_id
                    state.quiet_below = saved
                    checked["skipped"] += 1
            return ops

        sched._next_due_changes = checked_next_due
        sched._plan_compressions = checked_plan_compressions
        outputs = engine.generate(prompts, max_tokens=48, overrides=overrides)
    assert all(len(o) == 48 for o in outputs)
    assert sched.kvc_stats.preemptions > 0  # resumed requests' states were checked too
    assert checked["next_due"] > 500 and checked["skipped"] > 500, checked


@pytest.mark.mrv2
def test_admission_with_its_shortcuts_admits_what_a_fresh_forecast_admits(tiny_model):
    """`_admits` takes shortcuts (every request at its most fits the pool,
    or the free blocks on a hybrid; the kept forecast; a waiting request
    whose most fits beside the running peak): at every call, a forecast
    built afresh from the running requests as they stand must give the same
    answer. A pool that fills as requests start, so both the shortcuts and
    the full rule decide."""
    from vllm_kvcompress.admission import GrowthForecast

    prompts = random_prompts([100 + 19 * i for i in range(16)], seed=5)
    overrides = [SETTINGS[i % len(SETTINGS)] for i in range(len(prompts))]
    with in_process_engine(**engine_kwargs(tiny_model, num_gpu_blocks_override=64, max_num_seqs=16,
                                           max_model_len=512, max_num_batched_tokens=512,
                                           kv_compress_layer_groups=2,
                                           kv_compress={"policy": "snapkv", "budget": 64})) as engine:
        sched = engine.llm.llm_engine.engine_core.engine_core.scheduler
        admits = sched._admits
        decided = {True: 0, False: 0}

        def checked_admits(request):
            answer = admits(request)
            if sched.running and sched.kvc_states[request.request_id].plan is not None:
                fresh = GrowthForecast(sched.kvc_block_size, len(sched._kvc_managers), sched.max_num_scheduled_tokens)
                fresh.sync(sched._kvc_step, ((r.request_id, sched._outlook(r)) for r in sched.running))
                manager = sched.kv_cache_manager
                free = manager.block_pool.get_num_free_blocks() - manager.watermark_blocks
                assert answer == fresh.admits(sched._outlook(request), free), request.request_id
                # The whole-pool shortcut's premise: every block in use is
                # held by a running request (the rule counts those it holds).
                pool = manager.block_pool
                assert pool.num_gpu_blocks - 1 - pool.get_num_free_blocks() <= \
                    sum(sched._outlook(r).held for r in sched.running)
                decided[answer] += 1
            return answer

        sched._admits = checked_admits
        outputs = engine.generate(prompts, max_tokens=64, overrides=overrides)
    assert all(len(o) == 64 for o in outputs)
    assert decided[True] > 0 and decided[False] > 0, decided  # both answers were checked
