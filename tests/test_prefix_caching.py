"""Prefix caching changes speed, never answers.

A request's plan is a function of its prompt and settings, never of what the
prefix cache holds: its hit is capped where the request must compute (the
queries its scorer observes, the tokens from its first compression on), hit
tokens are compressible, and a compaction copies the kept ones into the
request's own fresh blocks, leaving the cached originals whole. So every
request equals the reference decoder run cold, whatever was cached before:
nothing, its whole prompt, half of it, or a conversation's previous turn.
`protect_prefix` keeps a shared prefix whole and shared instead.
"""

from __future__ import annotations

import pytest
import torch

from helpers import BLOCK_SIZE, engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.registry import POLICIES
from vllm_kvcompress.schedule import RequestSchedule, layer_groups

NEW_TOKENS = 32
NUM_LAYERS = 4  # the tiny model's; one KV cache group each, so every composition serves

# One request setting per policy (each compresses a ~300-token prompt), and
# the compositions beside them whose hit rule differs: a streamed prompt
# (compressed mid-prompt) and a protected prefix under a scorer of every query.
SETTINGS = {
    "snapkv": {"policy": "snapkv", "budget": 48, "window": 8},
    "snapkv-span": {"policy": "snapkv-span", "compression_ratio": 0.75, "window": 8},
    # Its generated tokens roll past 16: the next turn's prompt holds an answer computed on an evicted cache.
    "snapkv-span-window": {"policy": "snapkv-span-window", "compression_ratio": 0.75, "window": 8,
                           "decode_window": 16},
    "pyramidkv": {"policy": "pyramidkv", "budget": 48, "window": 8},
    "adaptive": {"policy": "adaptive", "budget": 48, "window": 8},
    "adakv": {"policy": "adakv", "budget": 48, "window": 8},
    "h2o": {"policy": "h2o", "budget": 48},
    "tova": {"policy": "tova", "budget": 40},
    "keyformer": {"policy": "keyformer", "budget": 48},
    "streamingllm": {"policy": "streamingllm", "budget": 48},
    "window": {"policy": "window", "budget": 48},
    "random": {"policy": "random", "budget": 48},
    "rkv": {"policy": "rkv", "budget": 16, "interval": 8},
    "knorm": {"policy": "knorm", "budget": 48},
    "expected_attention": {"policy": "expected_attention", "budget": 48},
    "minicache": {"policy": "minicache"},
    "streamed": {"policy": "streamingllm", "budget": 48, "prompt_chunk": 64},
    "h2o-protected": {"policy": "h2o", "budget": 48, "protect_prefix": 96},
    # Its repeat passes hit the prompt's blocks (each prompt in two passes).
    "kvzip": {"policy": "kvzip", "budget": 48, "chunk_size": 160},
}


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", enable_prefix_caching=True,
                                        kv_compress_layer_groups=NUM_LAYERS, max_model_len=2048,
                                        disable_log_stats=False))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


def engine_config(setting: dict | None) -> KVCompressConfig | None:
    return KVCompressConfig.from_dict({**setting, "layer_groups": NUM_LAYERS}) if setting else None


def expected(reference, prompt, setting) -> list[int]:
    return reference.generate(prompt, NEW_TOKENS, engine_config(setting), block_size=BLOCK_SIZE)["tokens"]


def schedule(prompt_len: int, setting: dict) -> RequestSchedule:
    plan = resolve_plan(engine_config(setting), prompt_len, NUM_LAYERS, BLOCK_SIZE)
    return RequestSchedule.create(plan, layer_groups(NUM_LAYERS, NUM_LAYERS))


def hit_cap(prompt_len: int, setting: dict) -> int:
    """The longest hit the request may take (vLLM's own: one token short of the prompt)."""
    cap = schedule(prompt_len, setting).longest_prefix_hit()
    return prompt_len - 1 if cap is None else min(cap, prompt_len - 1)


def blocks(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


@pytest.mark.extended
def test_every_policy_answers_the_same_whatever_the_cache_holds(engine, reference):
    """Per policy: its prompt cold, again once cached whole, another prompt
    whose first half was cached, and the conversation's next turn (prompt +
    answer + a new message): tokens equal to the reference decoder run cold in
    every case, hits as long as the policy allows, and compression on the
    hits. Afterwards the cached originals are whole: an uncompressed request
    hits every full block of each prompt and equals the uncompressed reference."""
    assert set(SETTINGS) >= set(POLICIES) - {"none"}, "a new policy needs its setting here"
    names = list(SETTINGS)
    settings = [SETTINGS[n] for n in names]
    prompts = random_prompts([280 + 9 * i for i in range(len(names))], seed=101)
    halves = random_prompts([300 + 5 * i for i in range(len(names))], seed=102)
    messages = random_prompts([40] * len(names), seed=103)
    n = len(names)

    # Cold; the first half of each other prompt cached by an uncompressed request.
    got = engine.generate_with_hits(prompts + [h[: len(h) // 2] for h in halves], NEW_TOKENS,
                                    settings + [None] * n)
    cold = got[:n]
    assert all(hit == 0 for _, hit in cold), [hit for _, hit in cold]
    # Again: the whole prompt cached; the other prompt with half of it cached.
    got = engine.generate_with_hits(prompts + halves, NEW_TOKENS, settings * 2)
    again, half = got[:n], got[n:]
    # The next turn: the previous turn's prompt cached, its answer not (it was
    # computed on a compressed cache: its blocks are never cached).
    turns = [p + answer + m for p, (answer, _), m in zip(prompts, cold, messages)]
    turn = engine.generate_with_hits(turns, NEW_TOKENS, settings)

    compressed_hits = 0
    for i, (name, setting) in enumerate(zip(names, settings)):
        want = reference.generate(prompts[i], NEW_TOKENS, engine_config(setting), block_size=BLOCK_SIZE)
        assert want["compressed_at"], f"{name}: the reference compresses"
        assert cold[i][0] == want["tokens"], f"{name}: cold"
        assert again[i][0] == want["tokens"], f"{name}: whole prompt cached (hit {again[i][1]})"
        assert half[i][0] == expected(reference, halves[i], setting), f"{name}: half cached (hit {half[i][1]})"
        assert turn[i][0] == expected(reference, turns[i], setting), f"{name}: next turn (hit {turn[i][1]})"
        # Hits: all the cache holds, up to the policy's cap.
        assert again[i][1] == blocks(hit_cap(len(prompts[i]), setting)), name
        assert half[i][1] == blocks(min(len(halves[i]) // 2, hit_cap(len(halves[i]), setting))), name
        assert blocks(min(len(prompts[i]), hit_cap(len(turns[i]), setting))) <= turn[i][1] \
            <= hit_cap(len(turns[i]), setting), name
        compressed_hits += again[i][1] > 0
    # What the rule allows: a hit up to the observation window (SnapKV family),
    # the last query (TOVA), the first compression (positions, keys); none for
    # scorers of every query (H2O, Keyformer, expected attention) without a protected prefix.
    assert again[names.index("snapkv")][1] >= len(prompts[0]) - 8 - BLOCK_SIZE
    assert again[names.index("h2o")][1] == again[names.index("keyformer")][1] == 0
    assert again[names.index("expected_attention")][1] == 0
    assert again[names.index("h2o-protected")][1] == 96
    assert compressed_hits >= len(names) - 3

    # The originals stayed whole in the cache: every block computed before
    # the first compression (a streamed prompt compresses mid-prompt).
    plain = engine.generate_with_hits(prompts, NEW_TOKENS, [None] * n)
    for prompt, setting, (tokens, hit) in zip(prompts, settings, plain):
        assert hit == blocks(min(len(prompt) - 1, schedule(len(prompt), setting).next_due(0)))
        assert tokens == expected(reference, prompt, None)


@pytest.mark.mrv2
def test_protected_prefix_is_shared_by_every_request(engine, reference):
    """With protect_prefix, requests sharing a system prompt hold one shared
    copy of its blocks plus their own compressed remainders (counted in the
    pool while they decode), and each equals the reference that protects it."""
    core = engine.llm.llm_engine
    scheduler = core.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    system = random_prompts((8 * BLOCK_SIZE,), seed=111)[0]
    prompts = [system + p for p in random_prompts([150 + 11 * i for i in range(6)], seed=112)]
    setting = {"policy": "snapkv", "budget": 48, "window": 8, "protect_prefix": len(system)}
    # The first request computes the prefix, the others hit it.
    (first, hit), = engine.generate_with_hits(prompts[:1], NEW_TOKENS, [setting])
    assert hit == 0
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            extra_args={"kv_compress": setting})
    for i, prompt in enumerate(prompts[1:]):
        core.add_request(f"shared-{i}", {"prompt_token_ids": prompt}, params)
    outputs: dict[str, list[int]] = {}
    held_while_decoding = None
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        managers = scheduler._kvc_managers
        running = [r.request_id for r in scheduler.running]
        if held_while_decoding is None and len(running) == 5 and all(
                scheduler.requests[r].num_computed_tokens > scheduler.requests[r].num_prompt_tokens
                for r in running):
            held_while_decoding = [{r: [b.block_id for b in m.req_to_blocks[r]] for r in running}
                                   for m in managers]
            free = pool.get_num_free_blocks()
    assert held_while_decoding is not None, "the five requests decoded together"
    shared = len(system) // BLOCK_SIZE
    for rows in held_while_decoding:  # per KV cache group
        heads = {tuple(row[:shared]) for row in rows.values()}
        assert len(heads) == 1, "one copy of the protected prefix"
        tails = [row[shared:] for row in rows.values()]
        assert len({b for t in tails for b in t}) == sum(len(t) for t in tails), "private remainders"
        # Each remainder holds the budget plus what was decoded since: a few blocks.
        assert all(len(t) <= -(-(48 + NEW_TOKENS) // BLOCK_SIZE) + 1 for t in tails), [len(t) for t in tails]
    assert free > 0
    tokens = [first] + [outputs[f"shared-{i}"] for i in range(len(prompts) - 1)]
    for prompt, got in zip(prompts, tokens):
        want = reference.generate(prompt, NEW_TOKENS, engine_config(setting), block_size=BLOCK_SIZE)
        assert got == want["tokens"]
        kept = want["kept_positions"][0]
        assert bool((kept[:, : len(system)] == torch.arange(len(system))).all()), "kept whole"


def test_decode_trigger_keeps_whole_hits(engine, reference):
    """Trigger 'decode' never compacts the prompt: prefix-cached prompts take
    their whole hit, generated tokens roll within their budget."""
    system = random_prompts((512,), seed=8)[0]
    prompts = [system + p for p in random_prompts((60, 90, 75), seed=9)]
    configs = [{"policy": "rkv", "budget": 16, "interval": 8},
               {"policy": "h2o", "trigger": "decode", "budget": 12, "interval": 8},
               {"policy": "rkv", "budget": 8, "interval": 4}]
    got = engine.generate_with_hits([prompts[0]], NEW_TOKENS, configs[:1])
    got += engine.generate_with_hits(prompts[1:], NEW_TOKENS, configs[1:])
    assert all(cached >= len(system) for _, cached in got[1:])
    for prompt, config, (tokens, _) in zip(prompts, configs, got):
        want = reference.generate(prompt, NEW_TOKENS, engine_config(config), block_size=BLOCK_SIZE)
        assert tokens == want["tokens"], config
        assert want["compressed_at"], "generated tokens were evicted"
