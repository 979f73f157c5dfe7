"""An fp8 KV cache (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2) with compression, exact.

vLLM's CPU cache writer stores keys and values rounded toward zero to the
fp8 format (cache_layout.truncate_to_fp8, checked here byte for byte and by
the worker at startup). The plugin reads the cache dequantised (scores,
masked heads, fused decode, MiniCache's merged layers), moves stored bytes
as they are when it compacts or copies, and writes MiniCache's merged vectors
rounded as vLLM rounds them; the reference decoder's fp8 mode caches every
key and value the same way, so every policy's tokens can be checked.

Up to near ties, and only there: vLLM computes keys and values with its own
kernels, the reference with Hugging Face's; they agree to about 1e-7, but
fp8 rounding is a step function, so an element within 1e-7 of a rounding
boundary is stored one quantum (1/8 of its value in e4m3, 1/4 in e5m2)
apart in the two. The few such elements move logits by about 1e-3: a greedy
choice between tokens whose logits are closer than NEAR_TIE can go either
way, the plugin's own attention passes (fused decode, masked heads) against
vLLM's kernel alike. A divergence is accepted only at such a token, after
which that request is not compared further (its context differs); most
tokens must be compared.
"""

from __future__ import annotations

import types

import pytest
import torch

from helpers import engine_kwargs, random_prompts, requires_cpu_fp8
from vllm_kvcompress.cache_layout import FP8_FORMATS, CacheDType, truncate_to_fp8
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.registry import POLICIES

NEW_TOKENS = 24
NUM_LAYERS = 4  # the tiny model's: one KV cache group per layer, so every policy serves
FP8 = ("fp8_e4m3", "fp8_e5m2")
# Policies added since the test was written go last: each earlier policy keeps
# its prompt and setting (which near ties the fp8 rounding meets is prompt-specific).
LATER = ["expected_attention", "kvzip"]
POLICY_NAMES = sorted(name for name in POLICIES if name not in ("none", *LATER)) + LATER
NEAR_TIE = 0.02  # logits: the runner-up this close to the greedy token may win (see above)


def setting(policy: str, i: int) -> dict:
    """One request setting per policy, compressing a ~100-200-token prompt."""
    trigger = POLICIES[policy].trigger
    if trigger == "decode":  # the prompt stays whole: a budget of generated tokens
        return {"policy": policy, "budget": 12, "interval": 8}
    if policy == "minicache":
        return {"policy": policy}
    config = {"policy": policy, "budget": 48 + 8 * (i % 3)}
    if trigger == "once_window":  # outputs past a window of 8 evicted
        config.update(decode_window=8, interval=4)
    return config


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.fixture(scope="module", params=FP8)
def fp8_engine(request, start_engine, tiny_model):
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=NUM_LAYERS,
                                          kv_cache_dtype=request.param, enable_prefix_caching=True))
    yield request.param, engine
    engine.close()


def expected(reference, prompt, config, dtype: str) -> dict:
    cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS}) if config else None
    return reference.generate(prompt, NEW_TOKENS, cfg, block_size=32, kv_cache_dtype=dtype)


def compared(got: list[int], want: dict, what: str) -> int:
    """How many tokens equal the reference's before they part, which they
    may only at a near tie of the reference's logits."""
    for i, (a, b) in enumerate(zip(got, want["tokens"])):
        if a != b:
            assert want["margins"][i] < NEAR_TIE, \
                f"{what}: token {i} differs ({a} for {b}) at a margin of {want['margins'][i]:.3g}"
            return i
    assert len(got) == len(want["tokens"]), what
    return len(got)


@requires_cpu_fp8
def test_stored_bytes_are_vllms():
    """truncate_to_fp8 stores what vLLM's CPU writer stores, byte for byte,
    over fp8's whole range (subnormals, saturation, infinities, NaN, zeros)."""
    from vllm import _custom_ops as ops

    head_dim, block = 64, 32
    magnitudes = torch.logspace(-12, 7, 64 * 100)
    x = torch.cat([magnitudes, -magnitudes, torch.randn(64 * 50) * 5,
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")] + [1.0] * 59)])
    n = x.numel() // head_dim
    num_blocks = -(-n // block)
    for name, fp8 in FP8_FORMATS.items():
        cache = torch.zeros(num_blocks, 1, block, 2 * head_dim, dtype=torch.uint8)
        key_cache, value_cache = cache.view(num_blocks, 1, 2 * block, head_dim).chunk(2, dim=2)
        rows = x.view(n, 1, head_dim)
        ops.cpu_attn_reshape_and_cache(rows, rows, key_cache, value_cache, torch.arange(n), "vec",
                                       kv_cache_dtype=name)
        # V is stored [block, head_dim] per (block, head): slot order.
        stored = cache.view(num_blocks, 1, 2, block * head_dim)[:, :, 1].reshape(-1)[: x.numel()]
        assert torch.equal(stored, truncate_to_fp8(x, fp8).view(torch.uint8)), name
        # Not torch's own cast (round to nearest): the rounding matters.
        assert not torch.equal(stored, x.to(fp8).view(torch.uint8)), name


@requires_cpu_fp8
def test_every_policy_equals_the_reference_fp8_mode(fp8_engine, reference):
    """One request per policy and one uncompressed, in one batch, each equal
    to the reference decoder caching as vLLM's fp8 writer does; then the same
    batch again, its prompts hit in the prefix cache (copies of fp8 blocks)."""
    dtype, engine = fp8_engine
    prompts = random_prompts([100 + 9 * i for i in range(len(POLICY_NAMES) + 1)], seed=61)
    configs = [setting(p, i) for i, p in enumerate(POLICY_NAMES)] + [None]
    before = engine.stats()
    cold = engine.generate_with_hits(prompts, NEW_TOKENS, configs)
    again = engine.generate_with_hits(prompts, NEW_TOKENS, configs)
    quantisation_matters, equal = False, 0
    for prompt, config, (tokens, hit), (tokens_again, _) in zip(prompts, configs, cold, again):
        want = expected(reference, prompt, config, dtype)
        assert hit == 0
        what = f"{dtype} {config} prompt {len(prompt)}"
        equal += compared(tokens, want, what)
        assert tokens_again == tokens, f"{what}: cached"  # the engine against itself: exact
        quantisation_matters |= want["tokens"] != expected(reference, prompt, config, "auto")["tokens"]
    assert equal >= 0.8 * NEW_TOKENS * len(prompts), f"{equal} of {NEW_TOKENS * len(prompts)} tokens compared"
    assert sum(hit > 0 for _, hit in again) >= len(POLICY_NAMES) // 2
    stats = engine.stats()
    assert stats["compressions"] - before["compressions"] >= 2 * len(POLICY_NAMES)
    # Bytes as well as blocks: a block holds one byte per cached K or V element.
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(engine.llm.llm_engine.model_config.model)
    head_dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    block_bytes = NUM_LAYERS * 2 * 32 * model.num_key_value_heads * head_dim
    assert stats["block_bytes"] == block_bytes
    assert stats["free_bytes"] == stats["free_blocks"] * block_bytes
    assert all(r["bytes_held"] == r["blocks_held"] * block_bytes > 0 for r in stats["requests"].values())
    # The fp8 mode is what made them equal: full precision answers otherwise.
    assert quantisation_matters, f"{dtype}: no answer changes with the cache's rounding"


@requires_cpu_fp8
def test_budget_above_the_need_equals_vanilla_fp8(start_engine, tiny_model, reference, fp8_engine):
    """Budgets above prompt + answer: the plugin's fp8 engine answers as
    vanilla vLLM's fp8 engine (no kv_compress) does: exactly where vLLM's
    kernel attends (snapkv, pyramidkv, none), up to near ties where the
    plugin's fused decode attention does (h2o, tova)."""
    dtype, engine = fp8_engine
    vanilla = start_engine(**engine_kwargs(tiny_model, kv_cache_dtype=dtype))
    prompts = random_prompts([150, 90, 210, 130, 170], seed=67)
    configs = [{"policy": "snapkv", "budget": 512}, {"policy": "pyramidkv", "budget": 512}, None,
               {"policy": "h2o", "budget": 400}, {"policy": "tova", "budget": 400}]
    try:
        got, plain = engine.generate(prompts, NEW_TOKENS, configs), vanilla.generate(prompts, NEW_TOKENS)
    finally:
        vanilla.close()
    assert got[:3] == plain[:3]
    for prompt, config, tokens, vanilla_tokens in zip(prompts[3:], configs[3:], got[3:], plain[3:]):
        want = {**expected(reference, prompt, None, dtype), "tokens": vanilla_tokens}
        assert compared(tokens, want, f"{dtype} {config}") > 0


def test_fp8_refusals(tiny_model):
    """What the plugin cannot serve exactly on a quantised cache is refused by name."""
    from vllm import LLM

    from vllm_kvcompress.vllm_seam.worker.startup import cache_dtype_of

    with pytest.raises(KVCompressConfigError, match=r"kv_cache_dtype=fp8_inc \(valid with compression here: auto, "):
        LLM(**engine_kwargs(tiny_model, kv_compress="snapkv", kv_compress_budget=64, kv_cache_dtype="fp8_inc"))
    layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn", _k_scale_float=0.5,
                                  _v_scale_float=1.0, impl=types.SimpleNamespace(kv_cache_dtype="fp8_e4m3"))
    with pytest.raises(RuntimeError, match="checkpoint's KV scales .*layer model.layers.0.self_attn.attn"):
        cache_dtype_of([layer], "CPU_ATTN")
    layer._k_scale_float = 1.0
    assert cache_dtype_of([layer], "CPU_ATTN") == CacheDType("fp8_e4m3")
    with pytest.raises(RuntimeError, match="'fp8_e4m3' is not supported on FLASH_ATTN"):
        cache_dtype_of([layer], "FLASH_ATTN")
    with pytest.raises(ValueError, match="valid values are auto, fp8, fp8_e4m3, fp8_e5m2"):
        CacheDType("int8")


def test_fp8_on_a_cpu_without_avx512_is_refused_by_name(tiny_model, monkeypatch):
    """Where vLLM's CPU attention cannot hold an fp8 cache (AVX2 without
    AVX-512 or AMX: its attention raises at the first step), compression on
    fp8 is refused at startup in one line naming the instruction set; the
    model's dtype is still served. The CPU's features are what torch reports,
    made those of an AVX2-only CPU here, so this runs on any machine."""
    from vllm import LLM

    from vllm_kvcompress.cache_layout import cpu_fp8_unserved
    from vllm_kvcompress.vllm_seam.engine_checks import prepare_engine_args

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_fp8_unserved() == "vLLM's CPU attention stores fp8 only with AVX-512 or AMX; this CPU has AVX2"
    for dtype in FP8:
        with pytest.raises(KVCompressConfigError) as refused:
            LLM(**engine_kwargs(tiny_model, kv_compress="snapkv", kv_compress_budget=64, kv_cache_dtype=dtype))
        message = str(refused.value)
        assert "\n" not in message and f"kv_cache_dtype={dtype} on this CPU" in message
        assert "AVX-512 or AMX; this CPU has AVX2" in message
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=tiny_model, kv_cache_dtype="auto",
                      additional_config={"kv_compress": {"policy": "snapkv", "budget": 64}})
    assert prepare_engine_args(args) is not None  # the model's dtype: served
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    assert cpu_fp8_unserved() is None
