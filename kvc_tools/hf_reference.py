"""The reference decoder through transformers' own forward pass.

For models whose every part but attention is too much to write out again
(Gemma 4: per-layer inputs, q/k/v norms, proportional partial RoPE, a global
head size apart from the sliding one): transformers runs the model, and its
attention calls, through `AttentionInterface`, the function here for every
layer. A sliding-window layer gets transformers' own SDPA attention. A
compressed (full-attention) layer attends, per KV head, to the logical
positions the compression kept (`RequestTokens.positions`, in the engine's
physical order), with each head's evicted slots masked, in float32, and feeds
the observed queries' logits to the same `RequestTokens` bookkeeping the
worker uses. transformers' cache keeps every key; compaction only changes
which positions a layer reads, which is what compacting a cache does (keys
are cached after RoPE, at their logical positions).

Shares with the engine what `reference_decoder` shares (plan, schedule,
scorers, selection); model code is transformers', attention here.
"""

from __future__ import annotations

import copy
import inspect

import torch

from vllm_kvcompress.cache_layout import CacheDType
from vllm_kvcompress.scorers.expected_attention import QueryGeometry
from vllm_kvcompress.token_state import RequestTokens

from .reference_decoder import ReferenceDecoder, dense_attention, gather_slots

ATTENTION = "kvc_reference"
# The decoder whose forward is running: transformers' attention calls carry no context of ours.
_running: list[HFAttentionReference] = []


class HFAttentionReference(ReferenceDecoder):
    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(ATTENTION, _attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                          attn_implementation=ATTENTION).eval()
        cfg = self.model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers)
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"HF reference: layer types {sorted(unknown)} are not supported")
        if getattr(cfg, "num_kv_shared_layers", 0):
            raise ValueError("HF reference: KV caches shared across layers are not supported (nor by the plugin)")
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("HF reference: attention logit soft caps are not supported (nor by the plugin)")
        self.compressed = {layer: i for i, layer in enumerate(
            layer for layer, t in enumerate(self.layer_types) if t == "full_attention")}
        self.num_q_heads = cfg.num_attention_heads
        layers = self.model.model.layers
        kv_heads = {layers[i].self_attn.k_proj.out_features // layers[i].self_attn.head_dim for i in self.compressed}
        if len(kv_heads) != 1:
            raise ValueError(f"HF reference: compressed layers with different KV head counts {sorted(kv_heads)}")
        self.num_kv_heads = kv_heads.pop()
        self.step: tuple[RequestTokens | None, torch.Tensor, torch.Tensor | None] | None = None
        self._on_logits = None  # KVzip's repeat passes (ReferenceDecoder._repeat_scores)
        # Expected attention: the queries reach the attention function after
        # RoPE, and are turned back with transformers' own tables.
        attention = layers[next(iter(self.compressed))].self_attn
        self.geometry = QueryGeometry(cos_sin=self._full_attention_cos_sin,
                                      max_position=cfg.max_position_embeddings, scale=attention.scaling)

    def _full_attention_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self.model.model.rotary_emb
        by_type = ("full_attention",) if "layer_type" in inspect.signature(rotary.forward).parameters else ()
        cos, sin = rotary(torch.zeros(1, dtype=self.model.dtype), positions.view(1, -1), *by_type)
        half = cos.shape[-1] // 2
        return cos[0, :, :half], sin[0, :, :half]

    def _empty_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _copy_cache(self, cache):
        # transformers' cache layers grow in place.
        return copy.deepcopy(cache)

    def _physical_kv(self, cache, layer: int, c: int, state: RequestTokens) -> tuple[torch.Tensor, torch.Tensor]:
        positions = state.positions(c)
        return gather_slots(cache.layers[layer].keys[0], positions), gather_slots(cache.layers[layer].values[0],
                                                                                 positions)

    def _compact(self, cache, layer: int, keep: torch.Tensor) -> None:
        pass  # every key stays in transformers' cache; the layer reads only RequestTokens.positions

    @torch.no_grad()
    def _forward(self, tokens: list[int], positions: torch.Tensor, cache, state,
                 cache_dtype: CacheDType) -> torch.Tensor:
        if cache_dtype.name != "auto":
            raise ValueError("HF reference: only kv_cache_dtype auto")
        observed = state.observed(positions) if state is not None else None
        if state is not None:
            state.append(positions)
        self.step = (state, positions, observed)
        _running.append(self)
        try:
            out = self.model(input_ids=torch.tensor([tokens]), position_ids=positions.view(1, -1),
                             past_key_values=cache, use_cache=True)
        finally:
            _running.pop()
        return out.logits[0, -1].float()


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [1, Hq, n, D], key and value
    [1, Hkv, T, D] (every cached position); returns ([1, n, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    decoder = _running[-1] if _running else None
    c = None if decoder is None else decoder.compressed.get(module.layer_idx)
    if decoder is None or c is None or decoder.step is None:  # a sliding-window layer: transformers' own
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    state, q_positions, observed = decoder.step
    hkv, group = key.shape[1], query.shape[1] // key.shape[1]
    positions = state.positions(c) if state is not None else \
        torch.arange(key.shape[2]).expand(hkv, -1)  # physical order: the engine's slots
    keys, values = (gather_slots(x[0], positions) for x in (key, value))
    hidden = positions.repeat_interleave(group, dim=0).unsqueeze(1) > q_positions.view(1, -1, 1)  # causal, logical
    dead = state.dead_slots(c, keys.shape[1]) if state is not None else None
    sinks = getattr(module, "sinks", None)
    out, logits = dense_attention(query[0], keys, values, query.shape[-1] ** -0.5 if scaling is None else scaling,
                                  hidden, dead, sinks)
    if decoder._on_logits is not None:  # a KVzip repeat pass (ReferenceDecoder._repeat_scores)
        decoder._on_logits(c, logits, sinks)
    if state is not None and observed is not None and observed.any():
        if state.scorer.observe.scores_attention():
            state.observe(c, logits[:, observed], q_positions[observed], sinks)
        else:  # expected attention: the queries themselves, turned back before RoPE
            assert decoder.geometry is not None
            state.observe_queries(c, decoder.geometry.unrotated(query[0][:, observed].transpose(0, 1),
                                                                q_positions[observed]))
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None
