"""Expected attention (kvpress's ExpectedAttentionPress): the math against a
plain-torch transcription of kvpress's formulas, and the engine's greedy
tokens against the reference decoder's.

The engine sees its queries after RoPE and turns them back with vLLM's own
cos/sin table; the reference decoder takes them before RoPE from its own
forward pass, and turns the moments with transformers' RoPE: equal tokens
check the un-turning, the chunked accumulation and the scoring together.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.scorers import Observation
from vllm_kvcompress.scorers.expected_attention import (
    ExpectedAttention,
    QueryGeometry,
    QueryMoments,
    unrotate,
)

NEW_TOKENS = 24


def _rope_tables(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb on [n, H, D] over the first 2 * cos.shape[-1] dims."""
    r = 2 * cos.shape[-1]
    c, s = torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1)
    half = r // 2
    xr = x[..., :r]
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * c + rotated * s, x[..., r:]], dim=-1)


def kvpress_scores(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_len: int,
                   n_future: int, n_sink: int, rotary_dim: int, covariance: bool) -> torch.Tensor:
    """kvpress's ExpectedAttentionPress.score, transcribed: queries [N, Hq, D]
    before RoPE (all of the prompt's), keys/values [Hkv, T, D] (T = q_len);
    the rotation matrix built per future position and averaged."""
    hq, d = queries.shape[1], queries.shape[2]
    hkv = keys.shape[0]
    h = queries[n_sink:].double()
    mu = h.mean(dim=0)  # [Hq, D]
    centred = h - mu
    cov = torch.einsum("nhd,nhe->hde", centred, centred) / h.shape[0]
    cos, sin = _rope_tables(torch.arange(q_len, q_len + n_future), rotary_dim)
    half = rotary_dim // 2
    rot = torch.zeros(n_future, d, d, dtype=torch.float64)
    for f in range(n_future):
        m = torch.eye(d, dtype=torch.float64)
        for i in range(half):
            m[i, i] = m[i + half, i + half] = cos[f, i]
            m[i, i + half], m[i + half, i] = -sin[f, i], sin[f, i]
        rot[f] = m
    r = rot.mean(dim=0)
    mu = mu @ r.T
    cov = r @ cov @ r.T
    k = keys[:, n_sink:].double().repeat_interleave(hq // hkv, dim=0)  # [Hq, T', D]
    logits = (k @ mu.unsqueeze(-1)).squeeze(-1) / math.sqrt(d)
    if covariance:
        logits += torch.einsum("htd,hde,hte->ht", k, cov, k) / d / 2
    probs = torch.softmax(logits, dim=-1).view(hkv, hq // hkv, -1).mean(dim=1)
    scores = probs * values[:, n_sink:].double().norm(dim=-1)
    return torch.cat([scores.max().expand(hkv, n_sink), scores], dim=1).float()


@pytest.mark.parametrize("rotary_dim,statistics", [(16, "covariance"), (8, "covariance"), (16, "mean")])
def test_scores_equal_kvpress_math(rotary_dim, statistics):
    """Moments accumulated in chunks from queries turned back from after
    RoPE, scored at the prompt's end, equal kvpress's formulas on the
    queries before RoPE (partial RoPE: rotary_dim below the head's 16)."""
    torch.manual_seed(0)
    n, hq, hkv, d, n_sink, n_future = 120, 4, 2, 16, 4, 64
    queries = torch.randn(n, hq, d) * 2 + torch.randn(hq, d)
    keys, values = torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    positions = torch.arange(n)
    scorer = ExpectedAttention(sink_tokens=n_sink, future_positions=n_future, statistics=statistics)
    moments = QueryMoments.empty(hq, d, scorer.query_covariance(), torch.device("cpu"))
    for chunk in torch.arange(n_sink, n).split(37):  # as the engine's chunked prefill does
        cos, sin = _rope_tables(chunk, rotary_dim)
        moments.add(unrotate(_rotate(queries[chunk], cos, sin), cos, sin))
    geometry = QueryGeometry(cos_sin=lambda p: _rope_tables(p, rotary_dim), max_position=4096, scale=d ** -0.5)
    obs = Observation(attention=None, positions=positions.expand(hkv, -1), num_kv_heads=hkv, layer=0,
                      num_compressions=0, keys=keys, values=values, query_moments=moments, geometry=geometry,
                      logical_len=n)
    want = kvpress_scores(queries, keys, values, n, n_future, n_sink, rotary_dim, statistics == "covariance")
    torch.testing.assert_close(scorer.score(obs), want, rtol=2e-4, atol=1e-7)


def test_unrotate_inverts_a_scaled_rope():
    """The inverse holds for tables that carry a magnitude (YaRN's mscale)."""
    torch.manual_seed(1)
    q = torch.randn(10, 3, 12)
    cos, sin = _rope_tables(torch.arange(100, 110), 8)
    cos, sin = cos * 1.3, sin * 1.3
    torch.testing.assert_close(unrotate(_rotate(q, cos, sin), cos, sin), q)


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    # A prompt of 300 tokens runs as three chunks: the moments add up over steps.
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", max_num_batched_tokens=128))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.mark.mrv2
def test_compositions_match_reference(engine, reference):
    """Expected attention alone, with span carry, the mean alone, a rolling
    trigger and a ratio, one batch with an uncompressed request; prompts in
    several chunks; greedy tokens equal the reference decoder's."""
    prompts = random_prompts((300, 180, 240, 150, 210, 120), seed=71)
    configs = [
        {"policy": "expected_attention", "budget": 64},
        {"policy": "expected_attention", "budget": 48, "selection": "span", "span": 8},
        {"policy": "expected_attention", "budget": 64, "statistics": "mean", "future_positions": 64},
        {"policy": "expected_attention", "budget": 40, "trigger": "rolling", "interval": 8},
        {"policy": "expected_attention", "compression_ratio": 0.75, "sink_tokens": 0},
        None,
    ]
    before = engine.stats()
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        assert tokens == reference.generate(prompt, NEW_TOKENS, cfg, block_size=32)["tokens"], config
    assert engine.stats()["compressions"] - before["compressions"] >= len(configs) - 1


def test_expected_attention_chooses_other_tokens_than_snapkv(reference):
    """The scorer is not a relabelled other one: on the same prompt and
    budget it keeps other positions than SnapKV and than the key norm."""
    prompt = random_prompts((200,), seed=72)[0]
    kept = {policy: reference.generate(prompt, 2, KVCompressConfig.from_dict({"policy": policy, "budget": 48}),
                                       block_size=32)["kept_positions"][1]
            for policy in ("expected_attention", "snapkv", "knorm")}
    assert not torch.equal(kept["expected_attention"].sort().values, kept["snapkv"].sort().values)
    assert not torch.equal(kept["expected_attention"].sort().values, kept["knorm"].sort().values)


def test_geometry_refuses_what_it_cannot_turn_back():
    """vLLM's own rotary embeddings: NeoX's table is read row by row (its
    cos then sin halves); GPT-J's interleaved layout, a subclass with its own
    forward (Phi-3's LongRoPE picks a table per batch), per-layer tables and a
    layer without a rotary embedding are refused, each named."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from vllm_kvcompress.vllm_seam.worker.startup import query_geometry

    class Attention(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.layer_name = name

    class Block(torch.nn.Module):  # a model's attention module: `attn` beside `rotary_emb`
        def __init__(self, name: str, rope: torch.nn.Module | None) -> None:
            super().__init__()
            self.attn = Attention(name)
            if rope is not None:
                self.rotary_emb = rope

        def forward(self, positions, q, k):
            return self.attn(*self.rotary_emb(positions, q, k))

    def geometry(*ropes):
        model = torch.nn.ModuleList([Block(f"layer{i}", rope) for i, rope in enumerate(ropes)])
        return query_geometry(model, [block.attn for block in model], [0.25] * len(ropes))

    with set_current_vllm_config(VllmConfig()):
        neox = RotaryEmbedding(16, 12, 256, 10000.0, True, torch.float32)
        other_base = RotaryEmbedding(16, 12, 256, 500.0, True, torch.float32)
        gptj = RotaryEmbedding(16, 16, 256, 10000.0, False, torch.float32)
        def forward_native(self, *args, **kwargs):
            return RotaryEmbedding.forward_native(self, *args, **kwargs)

        own_forward = type("OwnForward", (RotaryEmbedding,), {"forward_native": forward_native})(
            16, 16, 256, 10000.0, True, torch.float32)
    found, why = geometry(neox, neox)
    assert found is not None and why == "" and found.max_position == 256
    cos, sin = found.cos_sin(torch.tensor([0, 7]))
    want_cos, want_sin = _rope_tables(torch.tensor([0, 7]), 12)
    torch.testing.assert_close((cos, sin), (want_cos, want_sin))
    assert geometry(neox, other_base) == (None, "compressed layers with different rotary embeddings")
    assert geometry(gptj)[1] == "GPT-J-style (interleaved) rotary embedding"
    assert geometry(own_forward)[1] == "rotary embedding OwnForward (not a table indexed by position alone)"
    assert geometry(neox, None)[1] == "no rotary embedding found beside layer layer1"


def _bare(module: str, cls: str, **attrs) -> torch.nn.Module:
    """One of vLLM's attention modules, not built (no weights): only the
    attributes its forward's conditions read, set."""
    import importlib

    kind = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
    bare = kind.__new__(kind)
    torch.nn.Module.__init__(bare)
    for name, value in attrs.items():
        object.__setattr__(bare, name, value)
    return bare


@pytest.mark.parametrize("module,cls,attrs,turned", [
    ("llama", "LlamaAttention", {}, True),
    ("qwen3", "Qwen3Attention", {}, True),
    ("gpt_oss", "OAIAttention", {}, True),
    ("gemma3", "Gemma3Attention", {}, True),
    # Through a helper, eager or fused (its table handed to the kernel).
    ("qwen3_next", "Qwen3NextAttention", {"use_fused_qk_norm_rope_gate": False, "attn_output_gate": True}, True),
    ("qwen3_next", "Qwen3NextAttention", {"use_fused_qk_norm_rope_gate": True, "attn_output_gate": True}, True),
    ("gemma4", "Gemma4Attention", {"is_kv_shared_layer": False}, True),  # both branches turn
    # EXAONE 4 and Cohere 2: the full-attention layers (the compressed ones) are NoPE.
    ("exaone4", "Exaone4Attention", {"sliding_window": None, "apply_rope_all_layers": False}, False),
    ("exaone4", "Exaone4Attention", {"sliding_window": 4096, "apply_rope_all_layers": False}, True),
    ("exaone4", "Exaone4Attention", {"sliding_window": None, "apply_rope_all_layers": True}, True),
    ("commandr", "CohereAttention", {"v1": False, "sliding_window": None}, False),
    ("commandr", "CohereAttention", {"v1": True, "sliding_window": None}, True),
    ("granite", "GraniteAttention", {"use_rope": True}, True),
    ("granite", "GraniteAttention", {"use_rope": False}, False),
    ("exaone4", "Exaone4Attention", {"apply_rope_all_layers": False}, False),  # a condition not decided here
])
def test_rope_read_from_the_forward_per_layer(module, cls, attrs, turned):
    """Expected attention turns observed queries back by the layer's RoPE:
    a layer whose forward leaves them unturned (EXAONE 4's and Cohere 2's
    full-attention layers beside RoPE'd sliding ones: NoPE) would be turned
    back wrongly, so the forward's code is read with the layer's own
    attributes, and a path without RoPE, or one it cannot decide, refuses."""
    from vllm_kvcompress.vllm_seam.worker.startup import rope_not_applied

    problem = rope_not_applied(_bare(module, cls, **attrs))
    assert (problem is None) == turned, problem
    if not turned:
        assert problem == f"{cls}.forward does not turn this layer's queries by RoPE on every path"
