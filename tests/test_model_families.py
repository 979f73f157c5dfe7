"""Model families beyond Llama and Gemma 3 (issue 50): what is served and what is refused.

Qwen3 and Qwen3-MoE (q/k norm before RoPE; routed experts): every policy in
one batch gives the tokens of the reference decoder, which applies q/k norm
wherever the model has it and runs the model's own MLP (experts included).

Phi-4-mini and Phi-3.5-mini declare a sliding window (262,144) longer than
their context on every layer: a window that never slides is full attention,
and its layers compress. A window shorter than the context on every layer
leaves nothing to compress: refused by name. (The features the scorers would
not reproduce, gpt-oss's sinks, Gemma 2's soft cap and ALiBi, are refused in
tests/test_cli.py.)
"""

from __future__ import annotations

import functools

import pytest

from helpers import Engine, engine_kwargs, random_prompts, reused_turns
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.registry import POLICIES

NEW_TOKENS = 24
# gpt-oss under preemption: 3 long uncompressed fillers and 5 compressed
# requests overrun a pool of this many blocks (32 tokens; the sliding-window
# group takes its blocks from the same pool).
GPT_OSS_BLOCKS = 48
PREEMPTED_NEW_TOKENS = 96
# One KV cache group (per-layer budgets and MiniCache need grouped engines: the Llama tests).
POLICY_NAMES = sorted(name for name, c in POLICIES.items()
                      if name != "none" and c.allocation not in ("pyramid", "adaptive") and c.merge == "none")


def policy_config(policy: str, budget: int) -> dict:
    trigger = POLICIES[policy].trigger
    if trigger == "decode":  # the prompt stays whole: a budget of generated tokens
        return {"policy": policy, "budget": 12, "interval": 8}
    if trigger == "once_window":  # outputs past a window of 8 evicted
        return {"policy": policy, "budget": budget, "decode_window": 8, "interval": 4}
    return {"policy": policy, "budget": budget}


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe", "gpt-oss"])
def family(request):
    from kvc_tools.models import build_tiny_gpt_oss, build_tiny_qwen3, default_cache_root

    folder = default_cache_root() / "models" / f"tiny-{request.param}-seed0"
    if request.param == "gpt-oss":
        return str(build_tiny_gpt_oss(folder))
    return str(build_tiny_qwen3(folder, moe=request.param == "qwen3-moe"))


def run_every_policy(model: str, seed: int, names=POLICY_NAMES, shortest: int = 90, longest: int = 150,
                     per_request: dict | None = None, **engine_overrides):
    """Every policy of `names` in one batch (prompts from `shortest` up, 13
    tokens apart), then an uncompressed request and the same prompt (`longest`
    tokens) with a budget above the need: that one gives the uncompressed
    tokens, the compressed ones return blocks mid-request and the pool is whole
    at the end. `per_request`: settings added to each request's. Returns
    (prompts, request settings, tokens)."""
    extra = per_request or {}
    lengths = [shortest + 13 * i for i in range(len(names))] + [longest, longest]
    prompts = random_prompts(lengths, seed=seed)
    prompts[-1] = prompts[-2]
    configs = [{**policy_config(p, 48 + 8 * (i % 3)), **extra} for i, p in enumerate(names)]
    configs += [None, {"policy": "snapkv-span", "budget": 1000, **extra}]
    engine = Engine(in_process=True, **engine_kwargs(model, kv_compress="none", **engine_overrides))
    try:
        got = engine.generate(prompts, NEW_TOKENS, configs)
        stats = engine.stats()
    finally:
        engine.close()
    assert got[-1] == got[-2], "a budget above the need changed the tokens"
    assert stats["compressions"] >= len(names) and stats["blocks_freed"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]
    return prompts, configs, got


def every_policy_matches(model: str, reference, seed: int) -> None:
    """`run_every_policy`, and each request's tokens equal `reference`'s (a decoder of `model`)."""
    prompts, configs, got = run_every_policy(model, seed)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        want = reference(model).generate(prompt, NEW_TOKENS, cfg, block_size=32)["tokens"]
        assert tokens == want, f"{config} prompt {len(prompt)}"


@pytest.mark.mrv2
def test_every_policy_matches_the_reference(family):
    """Qwen3, Qwen3-MoE, gpt-oss against the written-out reference decoder."""
    from kvc_tools.reference_decoder import ReferenceDecoder

    every_policy_matches(family, functools.cache(ReferenceDecoder), seed=59)


@pytest.mark.extended  # ~30 s; the default run keeps gpt-oss's every-policy test
def test_gpt_oss_prefix_caching_and_preemption_keep_answers(start_engine):
    """gpt-oss with prefix caching on and a cache too small for the batch:
    requests share a system prompt (the full-attention group hits it, and
    compresses only what follows), the newest are preempted and replay their
    first life, and each gives the reference's tokens, sinks included."""
    from kvc_tools.models import build_tiny_gpt_oss, default_cache_root
    from kvc_tools.reference_decoder import ReferenceDecoder

    model = str(build_tiny_gpt_oss(default_cache_root() / "models" / "tiny-gpt-oss-seed0"))
    engine = start_engine(**engine_kwargs(model, kv_compress="none", enable_prefix_caching=True,
                                          num_gpu_blocks_override=GPT_OSS_BLOCKS, max_model_len=512))
    system = random_prompts((96,), seed=90)[0]
    fillers = random_prompts([220] * 3, seed=91)
    fillers[0] = system + fillers[0][len(system):]  # an uncompressed request computes the system prompt first
    prompts = [system + p for p in random_prompts([90 + 9 * i for i in range(5)], seed=92)]
    configs = [{"policy": "snapkv", "budget": 64, "window": 8}, {"policy": "h2o", "budget": 64},
               {"policy": "tova", "budget": 48, "window": 4}, {"policy": "streamingllm", "budget": 48},
               {"policy": "snapkv-span", "compression_ratio": 0.5}]
    before = engine.stats()["preemptions"]
    got = engine.generate_with_hits(fillers + prompts, PREEMPTED_NEW_TOKENS, [None] * 3 + configs)[3:]
    stats = engine.stats()
    assert stats["preemptions"] > before, "the cache was meant to be too small"
    preempted = {k.split("#")[0] for k in stats["requests"] if "#preempted" in k}
    assert any(r["finished"] and r["tokens_evicted"] for k, r in stats["requests"].items() if k in preempted)
    assert any(cached >= len(system) for _, cached in got), [c for _, c in got]
    assert stats["free_blocks"] == stats["total_blocks"]
    reference = ReferenceDecoder(model)
    for prompt, config, (tokens, cached) in zip(prompts, configs, got):
        want = reference.generate(prompt, PREEMPTED_NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=32)
        assert tokens == want["tokens"], f"{config} hit {cached}"
        assert want["compressed_at"]


@pytest.fixture(scope="module")
def exaone4():
    from kvc_tools.models import build_tiny_exaone4, default_cache_root

    return str(build_tiny_exaone4(default_cache_root() / "models" / "tiny-exaone4-seed0"))


@pytest.mark.mrv2
def test_exaone4_every_policy_matches_the_reference(exaone4):
    """EXAONE 4 turns queries and keys by RoPE in its sliding-window layers
    only: its full-attention layers, the compressed ones, take none. Every
    policy but expected attention gives the tokens of the reference run
    through transformers' own forward; expected attention, which would turn
    the observed queries back by a RoPE they never had, is refused: a
    request asking for it fails alone (the worker logs the layer and why;
    an engine started with it is refused at startup with the same line),
    the others go on. (Cohere 2 has the same layout and is refused alike,
    tests/test_expected_attention.py; a tiny one is not run here: vanilla
    vLLM's tokens and transformers' part from the first one.)"""
    from vllm import SamplingParams

    from kvc_tools.hf_reference import HFAttentionReference

    model = exaone4
    names = [name for name in POLICY_NAMES if POLICIES[name].scorer != "expected_attention"]
    assert len(names) < len(POLICY_NAMES)
    prompts, configs, got = run_every_policy(model, 73, names)
    reference = HFAttentionReference(model)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        assert tokens == reference.generate(prompt, NEW_TOKENS, cfg, block_size=32)["tokens"], config
    engine = Engine(in_process=True, **engine_kwargs(model, kv_compress="none"))
    try:
        params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, extra_args={"kv_compress": c})
                  for c in ({"policy": "expected_attention", "budget": 64}, {"policy": "snapkv", "budget": 64})]
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
    finally:
        engine.close()
    assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs] == [("error", 0), ("length", 8)]


@pytest.fixture(scope="module")
def phi3():
    from kvc_tools.models import build_tiny_phi3, default_cache_root

    return str(build_tiny_phi3(default_cache_root() / "models" / "tiny-phi3-seed0"))


def test_a_window_longer_than_the_context_compresses(phi3):
    """Phi-3-style: served; a budget above the need gives the uncompressed
    tokens, a small one evicts and returns blocks mid-request."""
    engine = Engine(in_process=True, **engine_kwargs(phi3, kv_compress="none"))
    try:
        config = engine.llm.llm_engine.vllm_config.model_config
        assert config.get_sliding_window() is None  # full attention: vLLM's disable_sliding_window
        prompts = random_prompts((300, 300, 300), seed=5)
        prompts = [prompts[0]] * 3
        settings = [None, {"policy": "snapkv", "budget": 1000}, {"policy": "snapkv", "budget": 64}]
        got = engine.generate(prompts, NEW_TOKENS, settings)
        stats = engine.stats()
    finally:
        engine.close()
    assert got[1] == got[0], "a budget above the need changed the tokens"
    compressed = [r for r in stats["requests"].values() if r["tokens_evicted"] > 0]
    assert len(compressed) == 1 and compressed[0]["blocks_freed"] > 0, stats["requests"]
    assert stats["free_blocks"] == stats["total_blocks"]


def test_a_window_shorter_than_the_context_is_refused(tmp_path):
    from vllm import LLM

    from kvc_tools.models import build_tiny_phi3
    from vllm_kvcompress import KVCompressConfigError

    model = str(build_tiny_phi3(tmp_path / "phi3-window64", sliding_window=64))
    with pytest.raises(KVCompressConfigError, match="a model without full-attention layers"):
        LLM(**engine_kwargs(model, kv_compress="snapkv", kv_compress_budget=64))


# Qwen3-Next's Gated DeltaNet layers run only in bfloat16 on vLLM's CPU
# backend (its C++ kernel; the reference runs transformers' torch version),
# so the two decoders' hidden states differ by bfloat16 rounding. Each engine
# token is fed to the reference (forced), which reports how far its logit
# falls below the reference's best: up to 0.69 measured for uncompressed
# requests over 24 tokens, 0.0 for policies that keep by position. A policy
# that ranks tokens by score can keep another token where two scores nearly
# tie, and then the outputs part by more (up to 3.2 for knorm, which ranks by
# key norms); against an uncompressed reference the same tokens fall 2-6 short.
BF16_DEFICIT = 1.0
BF16_LONG_DEFICIT = 0.75  # over PREEMPTED_NEW_TOKENS
POSITIONAL = ("random", "streamingllm")


def worst_deficit(model: str, new_tokens: int, block_size: int):
    """(prompt, config, engine tokens) -> the largest deficit of those tokens
    fed to the bfloat16 reference with that config's compression (at the
    engine's block size: where chunks and rolling evictions fall)."""
    import torch

    from kvc_tools.reference_decoder import ReferenceDecoder

    reference = ReferenceDecoder(model, dtype=torch.bfloat16)

    def worst(prompt, config, tokens) -> float:
        cfg = KVCompressConfig.from_dict(config) if config else None
        return max(reference.generate(prompt, new_tokens, cfg, block_size=block_size, forced=tokens)["deficits"])

    return worst


# vLLM sizes a Gated DeltaNet hybrid's attention blocks so that one holds a
# layer's state: 32 tokens of the tiny Qwen3-Next with a bfloat16 state, 64
# with a float32 one, which vLLM picks itself on CPUs with AVX-512 BF16. The
# tests pin the float32 state, so that engine and reference agree on 64-token
# blocks (where chunks end and rolling evictions fall) on every CPU.
QWEN3_NEXT_STATE = {"mamba_ssm_cache_dtype": "float32"}
QWEN3_NEXT_BLOCK = 64


@pytest.fixture(scope="module")
def qwen3_next():
    from kvc_tools.models import build_tiny_qwen3_next, default_cache_root

    return str(build_tiny_qwen3_next(default_cache_root() / "models" / "tiny-qwen3-next-seed0"))


def test_qwen3_next_compresses_beside_its_deltanet_state(qwen3_next):
    """The default run's Gated DeltaNet check (the reference ones are
    extended): the engine starts with the DeltaNet state groups left to
    vLLM, a budget above the need gives the uncompressed tokens, a small one
    evicts and returns blocks mid-request, and the pool is whole after."""
    engine = Engine(in_process=True, **engine_kwargs(qwen3_next, kv_compress="none", dtype="bfloat16"))
    try:
        prompt = random_prompts((400,), seed=66)[0]
        settings = [None, {"policy": "snapkv", "budget": 1000}, {"policy": "snapkv", "budget": 64}]
        got = engine.generate([prompt] * 3, NEW_TOKENS, settings)
        stats = engine.stats()
    finally:
        engine.close()
    assert got[1] == got[0], "a budget above the need changed the tokens"
    compressed = [r for r in stats["requests"].values() if r["tokens_evicted"] > 0]
    assert len(compressed) == 1 and compressed[0]["blocks_freed"] > 0, stats["requests"]
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.mrv2
def test_qwen3_next_compaction_zeroes_its_fresh_blocks(qwen3_next):
    """A hybrid's attention blocks share memory with its Gated DeltaNet
    state: a free block may hold a state's bytes, which read as keys and
    values are NaN, and a NaN past the kept tokens survives the masked
    slot's zero weight. vLLM zeroes the blocks it allocates; a compaction
    that copies (its prompt hit the prefix cache) takes fresh blocks
    itself. Here every free block is filled with NaN first (what a state
    left there reads as): vLLM's own requests and a compressed one whose
    kept tokens end mid-block give the tokens they give on a clean pool."""
    import torch

    from helpers import in_process_engine

    prompt = random_prompts((186,), seed=201)[0]  # its prompt's full blocks cached, at 32 or 64 tokens a block
    settings = [None, {"policy": "streamingllm", "budget": 48}, {"policy": "snapkv", "budget": 80, "window": 8}]
    with in_process_engine(**engine_kwargs(qwen3_next, kv_compress="none", dtype="bfloat16", max_model_len=512,
                                           enable_prefix_caching=True, num_gpu_blocks_override=64)) as engine:
        clean = [engine.generate_with_hits([prompt], NEW_TOKENS, [c])[0] for c in settings]
        core = engine.llm.llm_engine.engine_core.engine_core
        pool = core.scheduler.kv_cache_manager.block_pool
        stale = [b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is None]
        context = core.vllm_config.compilation_config.static_forward_context
        for name, layer in context.items():
            if name.endswith(".attn") and isinstance(layer.kv_cache, torch.Tensor):
                layer.kv_cache[stale] = float("nan")
        poisoned = [engine.generate_with_hits([prompt], NEW_TOKENS, [c])[0] for c in settings]
        stats = engine.stats()
        # `reuse` keeps sliding-window hybrids' states, not a DeltaNet state:
        # the request is refused alone, with the field named.
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        params = SamplingParams(max_tokens=4, extra_args={"kv_compress": {"policy": "snapkv", "budget": 64,
                                                                           "reuse": True}})
        with pytest.raises(VLLMValidationError, match=r"kv_compress.reuse: a Gated DeltaNet hybrid \(qwen3_next\)"):
            engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert stale and all(hit for _, hit in poisoned), "the prompt was meant to hit its cached blocks"
    assert sum(r["tokens_evicted"] > 0 for r in stats["requests"].values()) == 4
    for config, (want, _), (tokens, hit) in zip(settings, clean, poisoned):
        assert tokens == want, f"{config} (hit {hit}) read stale bytes from a fresh block"


@pytest.mark.extended  # ~60 s (bfloat16 on CPU, a reference pass per request and policy)
@pytest.mark.mrv2
def test_qwen3_next_every_policy_follows_the_reference(qwen3_next):
    """A Gated DeltaNet hybrid: its full-attention layers compress, its
    linear-attention state stays vLLM's. Every policy runs in one batch; fed
    to the reference (the model's own DeltaNet layers, the plugin's
    compression on its attention layers), the engine's tokens of the
    uncompressed and position-kept requests stay within BF16_DEFICIT of the
    reference's best logit; every policy's tokens sit far closer to their own
    compressed reference than to the uncompressed one (the check can fail: a
    plugin that kept the wrong tokens would not). A budget above the need
    gives vanilla's tokens exactly; blocks return mid-request."""
    # Two KV cache groups of attention layers: per-layer budgets too.
    names = POLICY_NAMES + ["pyramidkv", "adaptive"]
    prompts, configs, got = run_every_policy(qwen3_next, 67, names, shortest=300, longest=400,
                                             per_request={"layer_groups": 2}, dtype="bfloat16",
                                             kv_compress_layer_groups=2, **QWEN3_NEXT_STATE)
    worst = worst_deficit(qwen3_next, NEW_TOKENS, QWEN3_NEXT_BLOCK)
    own = {i: worst(p, c, t) for i, (p, c, t) in enumerate(zip(prompts, configs, got))}
    for i in (-2, -1, *(i for i, name in enumerate(names) if name in POSITIONAL)):
        assert own[i % len(configs)] <= BF16_DEFICIT, (configs[i], own[i % len(configs)])
    compressed = [i for i, name in enumerate(names) if name not in ("rkv",)]  # rkv: decode-time, mild here
    uncompressed = {i: worst(prompts[i], None, got[i]) for i in compressed}
    assert sum(own[i] for i in compressed) * 3 < sum(uncompressed.values()), (own, uncompressed)


@pytest.mark.extended  # ~60 s
def test_qwen3_next_prefix_caching_and_preemption(start_engine, qwen3_next):
    """Prefix caching on and a pool too small for the batch: requests share a
    system prompt, vLLM's Gated DeltaNet state and the compressed attention
    layers are recomputed after preemption. Each request's tokens, batched
    and preempted or alone, stay within BF16_LONG_DEFICIT of its reference
    (bfloat16's drift over 96 tokens: up to 0.44 measured, an uncompressed
    request's too). Batched and alone they may part at a near tie: a resumed
    request recomputes its DeltaNet state and attention in other chunks than
    alone, and in bfloat16 that moves logits by a few hundredths (measured:
    both tokens within 0.06 of the reference's best where they part).

    The pool holds GPT_OSS_BLOCKS' tokens (32-token blocks) in QWEN3_NEXT_BLOCK ones."""
    engine = start_engine(**engine_kwargs(qwen3_next, kv_compress="none", dtype="bfloat16",
                                          enable_prefix_caching=True, **QWEN3_NEXT_STATE,
                                          num_gpu_blocks_override=GPT_OSS_BLOCKS * 32 // QWEN3_NEXT_BLOCK,
                                          max_model_len=512))
    block_size = engine.llm.llm_engine.vllm_config.cache_config.block_size
    assert block_size == QWEN3_NEXT_BLOCK, f"attention blocks of {block_size} tokens, the pool sized for 64"
    system = random_prompts((96,), seed=93)[0]
    fillers = random_prompts([220] * 3, seed=94)
    fillers[0] = system + fillers[0][len(system):]
    prompts = [system + p for p in random_prompts([90 + 9 * i for i in range(4)], seed=95)]
    configs = [{"policy": "streamingllm", "budget": 48}, {"policy": "random", "budget": 64},
               {"policy": "streamingllm", "budget": 64, "prompt_chunk": 64}, None]
    before = engine.stats()["preemptions"]
    got = engine.generate_with_hits(fillers + prompts, PREEMPTED_NEW_TOKENS, [None] * 3 + configs)[3:]
    stats = engine.stats()
    assert stats["preemptions"] > before, "the cache was meant to be too small"
    preempted = {k.split("#")[0] for k in stats["requests"] if "#preempted" in k}
    assert any(r["finished"] and r["tokens_evicted"] for k, r in stats["requests"].items() if k in preempted)
    assert stats["free_blocks"] == stats["total_blocks"]
    alone = [engine.generate([p], PREEMPTED_NEW_TOKENS, [c])[0] for p, c in zip(prompts, configs)]
    worst = worst_deficit(qwen3_next, PREEMPTED_NEW_TOKENS, QWEN3_NEXT_BLOCK)
    for prompt, config, (tokens, cached), single in zip(prompts, configs, got, alone):
        assert worst(prompt, config, tokens) <= BF16_LONG_DEFICIT, f"{config} hit {cached}"
        if tokens != single:
            assert worst(prompt, config, single) <= BF16_LONG_DEFICIT, f"{config} alone"


@pytest.mark.extended  # a TP 2 engine: ~60 s
def test_gpt_oss_tensor_parallel_matches_the_reference():
    """Each rank holds its heads' sink logits (vLLM shards them with the
    heads): with tensor parallelism 2 every policy still gives the reference's
    tokens, masked per-head budgets (adakv) and decode scoring included."""
    import vllm.envs

    from kvc_tools.models import build_tiny_gpt_oss, default_cache_root
    from kvc_tools.reference_decoder import ReferenceDecoder

    model = str(build_tiny_gpt_oss(default_cache_root() / "models" / "tiny-gpt-oss-seed0"))
    configs = [{"policy": "snapkv", "budget": 48, "window": 8}, {"policy": "h2o", "budget": 56},
               {"policy": "adakv", "budget": 48}, {"policy": "tova", "budget": 48},
               {"policy": "keyformer", "budget": 48}, None]
    prompts = random_prompts([150 + 11 * i for i in range(len(configs))], seed=5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a core per rank
        engine = Engine(**engine_kwargs(model, kv_compress="none", tensor_parallel_size=2,
                                        distributed_executor_backend="mp", num_gpu_blocks_override=400))
        try:
            got = engine.generate(prompts, NEW_TOKENS, configs)
            stats = engine.stats()
        finally:
            engine.close()
    vllm.envs.disable_envs_cache()
    assert stats["compressions"] >= len(configs) - 1
    reference = ReferenceDecoder(model)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        assert tokens == reference.generate(prompt, NEW_TOKENS, cfg, block_size=32)["tokens"], config


@pytest.fixture(scope="module")
def gemma4():
    from kvc_tools.models import build_tiny_gemma4, default_cache_root

    return str(build_tiny_gemma4(default_cache_root() / "models" / "tiny-gemma4-seed0"))


@pytest.mark.mrv2
def test_gemma4_every_policy_matches_the_reference(gemma4):
    """Gemma 4 (global head size 512, q/k/v norms, per-layer inputs): its
    full-attention layers compress, its sliding ones stay vLLM's. Every policy
    in one batch gives the tokens of the reference run through transformers'
    own forward (kvc_tools/hf_reference.py: the plugin's compression in its
    attention); a budget above the need gives vanilla's tokens; blocks return."""
    from kvc_tools.hf_reference import HFAttentionReference

    every_policy_matches(gemma4, functools.cache(HFAttentionReference), seed=71)


def test_the_transformers_reference_equals_the_written_out_one(tiny_model):
    """kvc_tools/hf_reference.py against reference_decoder.py on the tiny
    Llama: the same tokens and kept positions for a prompt-time, a decode-time,
    a per-head, a streaming and an expected-attention policy (transformers'
    model code and cache against the written-out forward and dense caches;
    both attend through reference_decoder.dense_attention; expected
    attention's queries turned back from after transformers' RoPE against
    taken before the written-out one's)."""
    from kvc_tools.hf_reference import HFAttentionReference
    from kvc_tools.reference_decoder import ReferenceDecoder

    written, through_hf = ReferenceDecoder(tiny_model), HFAttentionReference(tiny_model)
    prompts = random_prompts([120, 133, 147, 160, 150], seed=73)
    configs = [{"policy": "snapkv", "budget": 48, "window": 8}, {"policy": "h2o", "budget": 40},
               {"policy": "adakv", "budget": 48}, {"policy": "streamingllm", "budget": 40, "prompt_chunk": 32},
               {"policy": "expected_attention", "budget": 48}]
    for prompt, config in zip(prompts, configs):
        cfg = KVCompressConfig.from_dict(config)
        want = written.generate(prompt, NEW_TOKENS, cfg, block_size=32)
        got = through_hf.generate(prompt, NEW_TOKENS, cfg, block_size=32)
        assert got["tokens"] == want["tokens"], config
        assert all(torch_equal(a, b) for a, b in zip(got["kept_positions"], want["kept_positions"])), config


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.parametrize("name", ["gpt-oss", "gemma4"])
def test_reuse_on_sliding_window_hybrids(start_engine, name):
    """`reuse` beside sliding-window layers with sinks (gpt-oss) and with a
    sliding-window block eight times the compressed group's (the tiny Gemma 4:
    256 and 32 tokens): each conversation's next two turns hit their whole
    history and answer as the reference continuing its own state."""
    from kvc_tools.hf_reference import HFAttentionReference
    from kvc_tools.models import build_tiny_gemma4, build_tiny_gpt_oss, default_cache_root
    from kvc_tools.reference_decoder import ReferenceDecoder

    build, decoder = (build_tiny_gpt_oss, ReferenceDecoder) if name == "gpt-oss" else \
        (build_tiny_gemma4, HFAttentionReference)
    model = str(build(default_cache_root() / "models" / f"tiny-{name}-seed0"))
    engine = start_engine(**engine_kwargs(model, kv_compress="none", enable_prefix_caching=True))
    reference = decoder(model)
    configs = [{"policy": "snapkv", "budget": 48, "window": 8, "reuse": True},
               {"policy": "tova", "budget": 40, "reuse": True}]
    prompts = random_prompts((150, 190), seed=74)
    extra = random_prompts((30, 41, 27, 36), seed=75)
    reused_turns(engine, reference, prompts, configs, [[extra[2 * turn % 4 + i] for i in range(2)]
                                                       for turn in range(3)], NEW_TOKENS, block_size=32)
