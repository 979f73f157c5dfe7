"""vLLM + plugin greedy tokens equal the plain-torch reference decoder.

One engine, compression configured as `none`, every request choosing its
policy and budget through `extra_args`: compressed and uncompressed requests of
different lengths share batches and join/leave at different steps. The engine
runs compiled (vLLM's default, not `enforce_eager`).
"""

from __future__ import annotations

import pytest
import torch

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.registry import POLICIES
from vllm_kvcompress.vllm_seam.worker import attention_passes, step_inputs

NEW_TOKENS = 40
LENGTHS = (200, 97, 150, 30, 260)
# Per-layer budgets need a grouped engine: tests/test_layer_groups.py.
POLICY_NAMES = sorted(name for name, c in POLICIES.items()
                      if name != "none" and c.allocation not in ("pyramid", "adaptive") and c.merge == "none")


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    # vLLM's default compilation, not eager: the model is compiled (on CPU
    # dynamo + inductor) around the attention op, which calls the plugin's
    # hooks at every step; on CUDA the same op is a piecewise graph's split.
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", enforce_eager=False))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.mark.extended
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_policy_matches_reference(engine, reference, policy):
    prompts = random_prompts(LENGTHS, seed=POLICY_NAMES.index(policy))
    # Budgets mixed within one batch; one request stays uncompressed.
    configs = [
        {"policy": policy, "budget": 64},
        {"policy": policy, "budget": 48},
        {"policy": policy, "compression_ratio": 0.5},
        None,
        {"policy": policy, "budget": 96},
    ]
    if POLICIES[policy].trigger == "decode":  # the prompt stays whole: budgets of generated tokens
        configs = [{"policy": policy, "budget": 16, "interval": 8}, {"policy": policy, "budget": 8, "interval": 4},
                   {"policy": policy, "budget": 12, "interval": 16}, None, {"policy": policy, "budget": 24}]
    if POLICIES[policy].trigger == "once_window":  # a window of outputs that slides within NEW_TOKENS
        configs = [{**c, "decode_window": 8 + 4 * i, "interval": 4} if c else None for i, c in enumerate(configs)]
    before = engine.stats()
    got = engine.generate(prompts, NEW_TOKENS, configs)
    after = engine.stats()
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=32)["tokens"]
        assert tokens == want, f"{policy} {config} prompt {len(prompt)}"
    assert after["tokens_evicted"] > before["tokens_evicted"]


def policy_config(policy: str, budget: int) -> dict:
    if POLICIES[policy].trigger == "decode":  # the prompt stays whole: a budget of generated tokens
        return {"policy": policy, "budget": 12, "interval": 8}
    if POLICIES[policy].trigger == "once_window":  # outputs past a window of 8 evicted
        return {"policy": policy, "budget": budget, "decode_window": 8, "interval": 4}
    return {"policy": policy, "budget": budget}


@pytest.mark.mrv2
def test_every_policy_in_one_batch_matches_reference(engine, reference):
    """One request per policy (and one uncompressed), all in one batch, each
    equal to the reference decoder: the per-policy tests above in one run of
    the engine (the one Model Runner V2 runs too: its steps are slow on CPU)."""
    lengths = [90 + 13 * i for i in range(len(POLICY_NAMES) + 1)]
    prompts = random_prompts(lengths, seed=53)
    configs = [policy_config(p, 48 + 8 * (i % 3)) for i, p in enumerate(POLICY_NAMES)] + [None]
    before = engine.stats()
    got = engine.generate(prompts, 24, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        assert tokens == reference.generate(prompt, 24, cfg, block_size=32)["tokens"], f"{config} {len(prompt)}"
    assert engine.stats()["compressions"] - before["compressions"] >= len(POLICY_NAMES)


def test_once_window_keeps_the_compressed_prompt_and_the_newest_outputs(engine, reference):
    """snapkv-span-window: the prompt compressed as snapkv-span compresses it,
    then of the outputs only the newest `decode_window` (up to an interval
    more) stay; a prompt under its budget is kept whole and its outputs
    windowed all the same."""
    prompts = random_prompts((210, 160, 120), seed=43)
    configs = [{"policy": "snapkv-span-window", "budget": 48, "decode_window": 8, "interval": 4},
               {"policy": "snapkv-span-window", "compression_ratio": 0.75, "decode_window": 16},
               {"policy": "snapkv-span-window", "budget": 200, "decode_window": 12, "interval": 8}]
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        out = reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=32)
        assert tokens == out["tokens"], f"{config} prompt {len(prompt)}"
        once = {k: v for k, v in config.items() if k not in ("decode_window", "interval")}
        prompt_kept = reference.generate(prompt, 2, KVCompressConfig.from_dict({**once, "policy": "snapkv-span"}),
                                         block_size=32)["kept_positions"]
        interval = config.get("interval", 32)
        cached = len(prompt) + NEW_TOKENS - 1  # the last output's KV is never written
        for layer, (kept, want) in enumerate(zip(out["kept_positions"], prompt_kept)):
            for head, (row, want_row) in enumerate(zip(kept.tolist(), want.tolist())):
                outputs = sorted(p for p in row if p >= len(prompt))
                assert sorted(p for p in row if p < len(prompt)) == sorted(p for p in want_row if p < len(prompt)), \
                    (config, layer, head)
                assert config["decode_window"] <= len(outputs) <= config["decode_window"] + interval, config
                assert outputs == list(range(cached - len(outputs), cached)), (config, layer, head)


@pytest.mark.parametrize("modifier", [{"selection": "span", "span": 8}, {"selection": "chunk", "chunk_length": 10}])
def test_selection_modifiers_match_reference(engine, reference, modifier):
    """Span carry and chunk selection around different scorers, in one batch."""
    prompts = random_prompts((230, 190, 260, 170), seed=37)
    configs = [
        {"policy": "snapkv", "budget": 64, "window": 8, **modifier},
        {"policy": "h2o", "budget": 48, **modifier},
        {"policy": "tova", "compression_ratio": 0.5, **modifier},
        {"policy": "snapkv", "budget": 64, "window": 8},  # the same without the modifier
    ]
    got = engine.generate(prompts[:3] + prompts[:1], NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts[:3] + prompts[:1], configs, got):
        want = reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=32)["tokens"]
        assert tokens == want, f"{config} prompt {len(prompt)}"
    kept = [reference.generate(prompts[0], 2, KVCompressConfig.from_dict(c), block_size=32)["kept_positions"][0]
            for c in (configs[0], configs[3])]
    assert not torch.equal(kept[0], kept[1]), "the modifier changes what is kept"


def test_snapkv_kept_window_matches_reference(engine, reference):
    """An observation window wider than what it keeps whole: the older window
    tokens compete for the budget (alone and with span carry)."""
    prompts = random_prompts((210, 180), seed=41)
    configs = [{"policy": "snapkv", "budget": 48, "window": 24, "kept_window": 4},
               {"policy": "snapkv", "budget": 40, "window": 16, "kept_window": 8, "selection": "span", "span": 6,
                "sink_tokens": 2}]
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        out = reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=32)
        assert tokens == out["tokens"], f"{config} prompt {len(prompt)}"
        # Some window tokens older than the kept ones were evicted.
        window = range(len(prompt) - config["window"], len(prompt) - config["kept_window"])
        kept = set(out["kept_positions"][0].flatten().tolist())
        assert not set(window) <= kept, config


def test_decode_trigger_matches_reference(engine, reference):
    """Any scorer that observes decode queries (or none) under trigger 'decode':
    the prompt stays whole, generated tokens roll within their budget."""
    prompts = random_prompts((150, 90, 200, 60), seed=43)
    configs = [
        {"policy": "h2o", "trigger": "decode", "budget": 16, "interval": 8},
        {"policy": "tova", "trigger": "decode", "budget": 12, "interval": 4},
        {"policy": "streamingllm", "trigger": "decode", "budget": 10, "interval": 8},
        {"policy": "keyformer", "trigger": "decode", "budget": 16, "interval": 8, "window": 4},
    ]
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        want = reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=32)
        assert tokens == want["tokens"], f"{config} prompt {len(prompt)}"
        assert want["compressed_at"], "generated tokens were evicted"
        kept = want["kept_positions"][0]
        assert bool((kept[:, : len(prompt)] == torch.arange(len(prompt))).all()), "the prompt stays whole"


@pytest.mark.parametrize("policy", [pytest.param("streamingllm", marks=pytest.mark.mrv2), "window"])
def test_streamed_prompt_matches_reference(engine, reference, policy):
    """Evicting while the prompt is prefilled: the engine ends each chunk where
    the planner says, whatever else is in the batch, so it matches the
    reference, which prefills in exactly those chunks."""
    prompts = random_prompts((260, 97, 200, 150), seed=31)
    configs = [
        {"policy": policy, "budget": 48, "prompt_chunk": 40},
        {"policy": policy, "budget": 40, "prompt_chunk": 16, "interval": 8},
        None,
        {"policy": policy, "compression_ratio": 0.75, "prompt_chunk": 64},
    ]
    got = engine.generate(prompts, NEW_TOKENS, configs)
    streamed = 0
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=32)
        assert tokens == want["tokens"], f"{config} prompt {len(prompt)}"
        streamed += cfg is not None and len(want["compressed_lengths"]) > NEW_TOKENS // 32 + 1
    assert streamed == 3, "every streamed prompt should have been evicted mid-prefill"
    # Streaming is not a no-op: the same budget without it gives other tokens.
    unstreamed = dict(configs[0], prompt_chunk=0)
    assert engine.generate(prompts[:1], NEW_TOKENS, [unstreamed])[0] != got[0]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_budget_above_need_equals_vanilla(engine, policy):
    """A budget no request reaches leaves vLLM's output unchanged."""
    prompts = random_prompts((120, 45), seed=7)
    rolling = POLICIES[policy].trigger == "rolling"
    # Prefill-time policies only need the prompt to fit; rolling ones the whole sequence.
    budgets = [len(p) + (NEW_TOKENS + 32 if rolling else 0) for p in prompts]
    plain = engine.generate(prompts, NEW_TOKENS)
    roomy = engine.generate(prompts, NEW_TOKENS, [{"policy": policy, "budget": b} for b in budgets])
    assert roomy == plain


def test_compression_changes_output(engine):
    """The equality tests above are not vacuous: evicting changes tokens."""
    prompts = random_prompts((200,), seed=3)
    plain = engine.generate(prompts, NEW_TOKENS)
    squeezed = engine.generate(prompts, NEW_TOKENS, [{"policy": "snapkv", "budget": 40, "window": 8}])
    assert plain != squeezed


@pytest.mark.parametrize("override, needle", [
    ({"policy": "snapkv", "budget": 8}, "kv_compress.budget"),
    ({"policy": "nope"}, "kv_compress.policy"),
    ("snapkv", "needs exactly one of budget"),  # a policy name alone; the engine has no budget
    (["snapkv"], "expected a policy name or an object"),
])
def test_bad_per_request_config_fails_that_request_only(engine, override, needle):
    from vllm.exceptions import VLLMValidationError

    prompts = random_prompts((50,), seed=9)
    with pytest.raises(VLLMValidationError, match=needle):
        engine.generate(prompts, 4, [override])
    assert len(engine.generate(prompts, 4)[0]) == 4  # the engine keeps serving


# ---------------------------------------------------------------- fused decode rows

FUSED_NEW_TOKENS = 24
FUSED_CONFIGS = [
    {"policy": "h2o", "budget": 48, "interval": 8},
    {"policy": "tova", "budget": 40, "interval": 4},
    {"policy": "rkv", "budget": 12, "interval": 8},
    {"policy": "keyformer", "budget": 48, "interval": 8},  # noisy logits: scored in a separate pass
    {"policy": "snapkv", "budget": 48},  # observes its prompt only
    None,
]
FUSED = {"h2o", "tova", "rkv"}  # the plain-softmax scorers


def test_fused_decode_rows_equal_reference_and_skip_vllms_pass(engine, reference, monkeypatch):
    """Requests of every kind share the batch; each equals the reference
    decoder, and the fused path (`decode_attention_with_scores`: vLLM's kernel
    attends one key for that row, the worker writes it) carried the decode
    steps of the plain-softmax scorers, and only theirs."""
    fused_policies: list[str] = []
    edited: list[tuple[list[int], list[int]]] = []  # (fused rows, their seq_lens in vLLM's metadata)
    attend_fused, apply = attention_passes.FusedDecode.run, step_inputs.MetadataEdits.apply

    def counting(self, layer, *args):
        fused_policies.extend(r.state.plan.scorer.name for r in self.step.fused)
        return attend_fused(self, layer, *args)

    def recording(self, cm, vllm_group):
        out = apply(self, cm, vllm_group)
        if len(self.fused_rows):
            edited.append((self.fused_rows.tolist(), out.seq_lens[self.fused_rows].tolist()))
        return out

    monkeypatch.setattr(attention_passes.FusedDecode, "run", counting)
    monkeypatch.setattr(step_inputs.MetadataEdits, "apply", recording)
    prompts = random_prompts((150, 120, 90, 140, 110, 60), seed=5)
    # Compiled, as vLLM runs by default: the hooks inside the attention op still run every step.
    got = engine.generate(prompts, FUSED_NEW_TOKENS, FUSED_CONFIGS)
    for prompt, config, tokens in zip(prompts, FUSED_CONFIGS, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        assert tokens == reference.generate(prompt, FUSED_NEW_TOKENS, cfg, block_size=32)["tokens"], config
    assert set(fused_policies) == FUSED
    assert edited and all(lens == [1] * len(rows) for rows, lens in edited)
