"""KVzip: the prompt scored by passes that repeat it (scorers/kvzip.py).

The engine runs each repeat pass as a request of its own once the prompt is
prefilled, and compresses the request on their scores before it decodes;
the reference decoder runs the same passes over a copy of its dense cache.
Greedy tokens must be equal.
"""

from __future__ import annotations

import pytest
import torch

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.scorers.kvzip import KVzip, RepeatPass, RepeatTokens, repeat_passes, subsample_scores

NEW_TOKENS = 12
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def repeat_tokens(tiny_model):
    from transformers import AutoTokenizer

    return RepeatTokens.of(AutoTokenizer.from_pretrained(tiny_model))


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    # Prompts in chunks of 128 tokens; the repeat passes hit the prompt's blocks in vLLM's prefix cache.
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", max_num_batched_tokens=128,
                                        enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


def _reference(reference, repeat_tokens, prompt, config):
    cfg = KVCompressConfig.from_dict(config) if config else None
    return reference.generate(prompt, NEW_TOKENS, cfg, block_size=32, repeat_tokens=repeat_tokens,
                              max_model_len=MAX_MODEL_LEN)


@pytest.mark.mrv2
def test_kvzip_matches_reference(engine, reference, repeat_tokens):
    """KVzip alone, in several repeat passes (chunks of 64 and 100 tokens),
    with span carry, a ratio and a protected start, one batch with an
    uncompressed request and a prompt within budget (no pass): greedy tokens
    equal the reference decoder's, and the passes' outputs never reach the client."""
    prompts = random_prompts((300, 180, 240, 150, 210, 60), seed=81)
    configs = [
        {"policy": "kvzip", "budget": 64},
        {"policy": "kvzip", "budget": 48, "chunk_size": 64},
        {"policy": "kvzip", "budget": 48, "selection": "span", "span": 8, "chunk_size": 100},
        {"policy": "kvzip", "compression_ratio": 0.75, "sink_tokens": 0, "overlap": 0, "chunk_size": 50},
        {"policy": "kvzip", "budget": 40, "protect_prefix": 16},
        {"policy": "kvzip", "budget": 64},
    ]
    before = engine.stats()
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        assert len(tokens) == NEW_TOKENS
        assert tokens == _reference(reference, repeat_tokens, prompt, config)["tokens"], config
    assert engine.stats()["compressions"] - before["compressions"] == len(configs) - 1


@pytest.mark.mrv2
def test_kvzip_batched_equals_alone(engine, reference, repeat_tokens):
    """Requests whose passes run beside each other and beside other
    requests' prefill and decode give what each gives alone."""
    prompts = random_prompts((260, 200, 230), seed=82)
    configs = [{"policy": "kvzip", "budget": 56, "chunk_size": 90}, None, {"policy": "kvzip", "budget": 72}]
    together = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, together):
        assert tokens == engine.generate([prompt], NEW_TOKENS, [config])[0], config


def test_kvzip_chooses_other_tokens_than_snapkv(reference, repeat_tokens):
    """Not a relabelled other scorer: on the same prompt and budget it keeps
    other positions than SnapKV and than expected attention."""
    prompt = random_prompts((200,), seed=83)[0]
    kept = {policy: _reference(reference, repeat_tokens, prompt, {"policy": policy, "budget": 48})[
        "kept_positions"][1] for policy in ("kvzip", "snapkv", "expected_attention")}
    assert not torch.equal(kept["kvzip"].sort().values, kept["snapkv"].sort().values)
    assert not torch.equal(kept["kvzip"].sort().values, kept["expected_attention"].sort().values)


def test_repeat_passes_chunk_the_prompt_as_kvpress():
    """The passes cover the prompt in chunks; the first one's instruction is
    the first, a later one's the next instruction and the `overlap` tokens
    before its chunk; a chunk shrinks where max_model_len leaves less room,
    and a prompt with no room for any pass is refused, naming max_model_len."""
    tokens = RepeatTokens(first=(1, 2), next=(3,), suffix=(9,))
    context = list(range(100, 125))
    passes = repeat_passes(context, KVzip(chunk_size=10, overlap=2), tokens)
    assert [(p.start, p.end) for p in passes] == [(0, 10), (10, 20), (20, 25)]
    assert passes[0].tokens == (1, 2, 9, *range(100, 110))
    assert passes[1].tokens == (3, 108, 109, 9, *range(110, 120))
    assert all(p.context_len == 25 for p in passes)
    # Room for 25 + 3 (the longest head: the next instruction and 2 tokens) + 1 + a chunk of 6, and the
    # token the pass samples.
    assert [(p.start, p.end) for p in repeat_passes(context, KVzip(chunk_size=10, overlap=2), tokens, 36)] == \
        [(0, 6), (6, 12), (12, 18), (18, 24), (24, 25)]
    with pytest.raises(ValueError, match="max_model_len 30"):
        repeat_passes(context, KVzip(chunk_size=10, overlap=2), tokens, 30)


def test_subsample_scores_are_kvpress_softmax():
    """A pass's query's softmax holds the sinks, its chunk and the pass's
    own tokens up to itself (and a model's sink logit, gpt-oss); the chunk's
    scores are the highest over the queries and the KV head's query heads."""
    torch.manual_seed(0)
    rp = RepeatPass(context_len=20, start=8, end=12, sink_tokens=2, tokens=(0,) * 5)
    logits = torch.randn(2, 3, 5, 2 + 4 + 5)  # [Hkv, G, n, sinks + chunk + own]
    q_slots = torch.arange(20, 25)
    for sinks in (None, torch.randn(2, 3)):
        got = subsample_scores(logits, rp, q_slots, sinks)
        want = torch.zeros(2, 4)
        for h in range(2):
            for g in range(3):
                for i in range(5):
                    visible = logits[h, g, i, : 6 + i + 1]  # sinks, chunk, own tokens to itself
                    if sinks is not None:
                        visible = torch.cat([visible, sinks[h, g].view(1)])
                    want[h] = torch.maximum(want[h], torch.softmax(visible, dim=-1)[2:6])
        torch.testing.assert_close(got, want)


@pytest.mark.mrv2
def test_kvzip_budgets_follow_its_scores(start_engine, tiny_model, reference, repeat_tokens):
    """Per-head and adaptive budgets share the budget by the repeat passes'
    scores: the workers report them in the step the last pass ends (passes
    in chunks of 128 tokens a step, several per prompt), and the request
    compresses to them before its second token. Greedy tokens equal the
    reference's (which derives them from the same scores), layers keep
    different counts (adaptive) and heads masked slots (per_head)."""
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", max_num_batched_tokens=128,
                                          enable_prefix_caching=True, max_model_len=MAX_MODEL_LEN,
                                          kv_compress_layer_groups=2))
    prompts = random_prompts((300, 240, 210, 260), seed=86)
    configs = [{"policy": "kvzip", "budget": 64, "allocation": "per_head"},
               {"policy": "kvzip", "budget": 48, "allocation": "per_head", "alpha": 0.5, "chunk_size": 90},
               {"policy": "kvzip", "budget": 56, "allocation": "adaptive", "chunk_size": 70},
               {"policy": "kvzip", "budget": 64, "allocation": "adaptive", "coverage": 0.5}]
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        want = _reference(reference, repeat_tokens, prompt, {**config, "layer_groups": 2})
        assert tokens == want["tokens"], config
        if config["allocation"] == "per_head":
            assert sum(want["dead_slots"]) > 0, config
    kept = [r["tokens_kept_per_group"] for r in engine.stats()["requests"].values() if r["finished"]]
    assert any(len(set(k)) > 1 for k in kept), kept  # adaptive: the two groups keep different counts


def test_kvzip_refuses_what_it_cannot_serve():
    """A trigger other than once, merges, and budgets from the passes' scores
    beside `reuse` (a continuing request runs no pass) are refused, each
    naming its field."""
    for extra, field in (({"trigger": "rolling"}, "trigger"), ({"merge": "minicache"}, "merge"),
                         ({"allocation": "per_head", "reuse": True}, "reuse"),
                         ({"allocation": "adaptive", "layer_groups": 2, "reuse": True}, "reuse")):
        with pytest.raises(ValueError, match=field):
            KVCompressConfig.from_dict({"policy": "kvzip", "budget": 64, **extra}).components()


@pytest.mark.mrv2
def test_kvzip_survives_preemption(start_engine, tiny_model, reference, repeat_tokens):
    """A pool too small for everyone: requests and their repeat passes are
    preempted and resumed; each KVzip request still equals the reference,
    and every block comes back (no pass leaks one)."""
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", num_gpu_blocks_override=30,
                                          enable_prefix_caching=True, max_model_len=512))
    fillers = random_prompts([150] * 2, seed=84)
    prompts = random_prompts([200 + 9 * i for i in range(7)], seed=85)
    configs = [{"policy": "kvzip", "budget": 48, "chunk_size": 64 + 16 * i} for i in range(len(prompts))]
    before = engine.stats()["preemptions"]
    got = engine.generate(fillers + prompts, 96, [None] * len(fillers) + configs)[len(fillers):]
    stats = engine.stats()
    assert stats["preemptions"] > before, "the cache was meant to be too small"
    assert stats["free_blocks"] == stats["total_blocks"]
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config)
        want = reference.generate(prompt, 96, cfg, block_size=32, repeat_tokens=repeat_tokens,
                                  max_model_len=512)["tokens"]
        assert tokens == want, config


@pytest.mark.mrv2
def test_kvzip_passes_never_wait_on_requests_that_wait_for_them(start_engine, tiny_model, reference,
                                                                  repeat_tokens):
    """Two prefilled requests hold most of a small pool while they wait for
    their repeat passes, which need blocks of their own: the scheduler
    preempts a waiting request (its blocks stay cached for its passes to
    hit) instead of idling forever, and both answers equal the reference."""
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", num_gpu_blocks_override=18,
                                          enable_prefix_caching=True, max_model_len=512))
    prompts = random_prompts([250, 240], seed=86)
    configs = [{"policy": "kvzip", "budget": 48}] * 2
    got = engine.generate(prompts, 16, configs)
    stats = engine.stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    for prompt, config, tokens in zip(prompts, configs, got):
        want = reference.generate(prompt, 16, KVCompressConfig.from_dict(config), block_size=32,
                                  repeat_tokens=repeat_tokens, max_model_len=512)["tokens"]
        assert tokens == want


def test_kvzip_keeps_a_continuing_requests_new_tokens(reference, repeat_tokens):
    """A request continuing a saved KVzip state (`reuse`: a question on a
    document compressed once) runs no repeat pass: its own tokens are kept
    whole, and the state's tokens give way by their scores (it keeps a subset
    of what the document kept)."""
    from kvc_tools.reference_decoder import at_length

    document, question = random_prompts((300, 30), seed=87)
    cfg = KVCompressConfig.from_dict({"policy": "kvzip", "budget": 64, "reuse": True})
    first = reference.generate(document, NEW_TOKENS, cfg, block_size=32, repeat_tokens=repeat_tokens)
    out = reference.generate(document + question, NEW_TOKENS, cfg, block_size=32,
                             resume=at_length(first, len(document)))
    new = set(range(len(document), len(document) + len(question)))
    for before, after in zip(first["kept_positions"], out["kept_positions"]):
        for head_before, head_after in zip(before, after):
            kept, document_kept = set(head_after.tolist()), {p for p in head_before.tolist() if p < len(document)}
            assert new <= kept
            assert {p for p in kept if p < len(document)} < document_kept  # a subset: some gave way


@pytest.mark.extended  # ~40 s: 300 tokens each under preemption
@pytest.mark.mrv2
def test_kvzip_preempted_after_its_compression_replays_it(start_engine, tiny_model, reference, repeat_tokens):
    """Uncompressed neighbours grow until the pool runs out and vLLM preempts
    the newest requests, the KVzip ones, after their compression: their
    workers kept no scores, so their replay runs the passes again, compresses
    the same, and each answer still equals the reference."""
    # Growth-aware admission off: vLLM admits all and preempts as the cache fills.
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_reserve_growth=0,
                                          num_gpu_blocks_override=24, enable_prefix_caching=True,
                                          max_model_len=512))
    fillers = random_prompts([120, 120], seed=88)
    prompts = random_prompts([110, 100], seed=89)
    configs = [{"policy": "kvzip", "budget": 40}] * 2
    before = engine.stats()["preemptions"]
    got = engine.generate(fillers + prompts, 300, [None, None] + configs)[2:]
    stats = engine.stats()
    assert stats["preemptions"] > before, "the cache was meant to be too small"
    assert stats["free_blocks"] == stats["total_blocks"]
    for prompt, config, tokens in zip(prompts, configs, got):
        want = reference.generate(prompt, 300, KVCompressConfig.from_dict(config), block_size=32,
                                  repeat_tokens=repeat_tokens, max_model_len=512)["tokens"]
        assert tokens == want


def test_a_prompt_without_room_for_its_pass_fails_alone(engine):
    """A prompt so close to max_model_len that no repeat pass fits beside it
    fails alone (finish reason error, no token), and its neighbour goes on."""
    from vllm import SamplingParams

    long, short = random_prompts((MAX_MODEL_LEN - 20, 150), seed=90)
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                             extra_args={"kv_compress": {"policy": "kvzip", "budget": 64}}) for _ in range(2)]
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in (long, short)], params, use_tqdm=False)
    assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs] == [("error", 0), ("length", 8)]


def test_passes_that_fill_max_model_len_leave_room_for_their_token(engine, reference, repeat_tokens):
    """A prompt long enough that its chunks shrink to fit max_model_len: each
    pass with its longest instruction ends one token short of it (the token
    it samples; a pass filling it killed the engine: vLLM fails a step whose
    sampled token passes max_model_len), and the request equals the reference."""
    scorer = KVzip()
    extra = max(len(repeat_tokens.first), len(repeat_tokens.next) + scorer.overlap) + len(repeat_tokens.suffix)
    prompt = random_prompts((MAX_MODEL_LEN - extra - 1 - 300,), seed=91)[0]
    passes = repeat_passes(prompt, scorer, repeat_tokens, MAX_MODEL_LEN)
    assert len(passes) > 1 and max(len(prompt) + len(p.tokens) for p in passes) == MAX_MODEL_LEN - 1
    config = {"policy": "kvzip", "budget": 64}
    assert engine.generate([prompt], NEW_TOKENS, [config])[0] == \
        _reference(reference, repeat_tokens, prompt, config)["tokens"]
