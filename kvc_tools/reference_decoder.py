"""Plain-torch reference decoder: the test oracle for the vLLM integration.

A Llama (Qwen3, Gemma 3 or gpt-oss) forward pass written out with an explicit,
dense KV cache per layer (`[num_kv_heads, T, head_dim]`, keys after RoPE).
Gemma 3 and gpt-oss are hybrid models: their sliding-window layers keep every
token and mask by logical distance (the window), and only their
full-attention layers compress, as in the engine. gpt-oss's learned sink
logit per head sits in every softmax's denominator (the output's and the
scores'). Attention probabilities are
computed explicitly, used for the output and, for the queries the scorer
observes, fed to the same `RequestTokens` bookkeeping the worker uses.
Compressions happen exactly when the schedule says (schedule.py) (the scheduler's state
machine), so greedy tokens must equal vLLM's with the plugin. With an fp8
`kv_cache_dtype` every key and value is cached as vLLM's CPU writer rounds it
(cache_layout.CacheDType), MiniCache's stored vectors too.

It shares with the engine only the plan, the scorers' math, the selection,
the merge formulas (merge.py) and the schedule (schedule.py); attention, attention scores,
RoPE, caching and compaction are independent code. A merged pair's upper
layer keeps its restored keys and values densely, the engine's reads the
lower layer's paged slots.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from vllm_kvcompress.cache_layout import CacheDType
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.merge import restore
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.schedule import RequestSchedule, layer_groups
from vllm_kvcompress.scorers.expected_attention import QueryGeometry
from vllm_kvcompress.token_state import MergedUpper, RequestTokens


class ReferenceDecoder:
    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        cfg = self.model.config
        self.gemma = cfg.model_type in ("gemma3_text", "gemma3")
        self.gpt_oss = cfg.model_type == "gpt_oss"
        # Qwen3-Next: Gated DeltaNet layers beside gated full attention (partial RoPE).
        self.qwen3_next = cfg.model_type == "qwen3_next"
        if cfg.model_type not in ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_next") \
                and not self.gemma:
            raise ValueError(f"reference decoder supports Llama-like, Qwen3, Qwen3-Next, Gemma 3 and gpt-oss "
                             f"models, not {cfg.model_type}")
        # Qwen's configs carry a window that only `use_sliding_window` turns on.
        windowed = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
        if windowed and not (self.gemma or self.gpt_oss):
            raise ValueError("reference decoder: sliding windows only for Gemma 3's and gpt-oss's layer types")
        attentions = [layer.self_attn for layer in self.model.model.layers if hasattr(layer, "self_attn")]
        # Per-head RMSNorm of q and k before RoPE (Gemma 3, Qwen3): wherever the model has it.
        self.qk_norm = hasattr(attentions[0], "q_norm")
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("reference decoder: attention logit soft caps are not supported (nor by the plugin)")
        self.num_layers = cfg.num_hidden_layers
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = cfg.query_pre_attn_scalar ** -0.5 if self.gemma else self.head_dim ** -0.5
        layer_types = (getattr(cfg, "layer_types", None) if windowed or self.gemma or self.qwen3_next else None) \
            or ["full_attention"] * self.num_layers
        # gpt-oss: [Hq] sink logits per layer (None: a plain softmax).
        self.sinks = [getattr(getattr(layer, "self_attn", None), "sinks", None) for layer in self.model.model.layers]
        # Per layer: the sliding window (None: full attention, which compresses).
        self.window = [cfg.sliding_window if t == "sliding_attention" else None for t in layer_types]
        self.layer_types = layer_types
        # Model layer -> index among the compressed (full-attention) layers.
        self.compressed = {layer: i for i, layer in enumerate(
            layer for layer, t in enumerate(layer_types) if t == "full_attention")}
        # Expected attention's view of the compressed layers' queries: HF's RoPE
        # tables (the first half of each: NeoX's layout repeats it), HF's scale.
        self.geometry: QueryGeometry | None = QueryGeometry(
            cos_sin=self._full_attention_cos_sin, max_position=cfg.max_position_embeddings, scale=self.scale)
        # KVzip's repeat passes read every compressed layer's logits (`_repeat_scores`).
        self._on_logits: Callable[..., None] | None = None

    # ------------------------------------------------------------ model

    def _rope_tables(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, (cos, sin) [n, D] at logical `positions` (one RoPE base per
        Gemma layer type; Llama's one for every layer): computed once per forward."""
        rotary = self.model.model.rotary_emb
        tables = {}
        for layer_type in set(self.layer_types) - {"linear_attention"}:
            if self.gemma:
                cos, sin = rotary(x, positions.view(1, -1), layer_type)
            else:
                cos, sin = rotary(x, positions.view(1, -1))
            cos, sin = cos[0].to(x.dtype), sin[0].to(x.dtype)
            if self.gpt_oss:  # its tables cover one half (the same rotation)
                cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
            tables[layer_type] = (cos, sin)
        return tables

    def _full_attention_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [n, R / 2] of the full-attention layers' RoPE at `positions`."""
        x = torch.zeros(1, dtype=self.model.dtype)
        cos, sin = self._rope_tables(x, positions)["full_attention"]
        half = cos.shape[-1] // 2
        return cos[:, :half], sin[:, :half]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [H, n, D] rotated by (cos, sin) [n, R] (HF's rotate_half form) over its first R
        dims, the rest passed through (partial RoPE: Qwen3-Next rotates a quarter)."""
        x, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1]:]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return torch.cat([x * cos + rotated * sin, rest], dim=-1)

    @torch.no_grad()
    def _forward(self, tokens: list[int], positions: torch.Tensor, cache, state,
                 cache_dtype: CacheDType) -> torch.Tensor:
        """Run `tokens` at logical `positions`; append to `cache` (as `cache_dtype` stores them); return last logits."""
        m = self.model.model
        x = m.embed_tokens(torch.tensor(tokens)).to(self.model.dtype)  # [n, hidden]
        n = len(tokens)
        observed = state.observed(positions) if state is not None else None
        if state is not None:
            state.append(positions)
        rope = self._rope_tables(x, positions)
        for layer_idx, layer in enumerate(m.layers):
            h = layer.input_layernorm(x)
            if self.layer_types[layer_idx] == "linear_attention":
                # Gated DeltaNet: the model's own layer, its recurrent and
                # conv states in the cache's slot (never compressed).
                x = x + layer.linear_attn(h.unsqueeze(0), cache_params=cache[layer_idx])[0]
                x = x + layer.mlp(layer.post_attention_layernorm(x).unsqueeze(0))[0]
                continue
            attn = layer.self_attn
            gate = None
            if self.qwen3_next:  # the query projection also gives each head's output gate
                q, gate = attn.q_proj(h).view(n, self.num_q_heads, 2 * self.head_dim).chunk(2, dim=-1)
                gate = gate.reshape(n, -1)
            else:
                q = attn.q_proj(h).view(n, self.num_q_heads, self.head_dim)
            k = attn.k_proj(h).view(n, self.num_kv_heads, self.head_dim)
            if self.qk_norm:  # per-head RMSNorm of q and k before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(0, 1), k.transpose(0, 1)
            v = attn.v_proj(h).view(n, self.num_kv_heads, self.head_dim).transpose(0, 1)
            cos, sin = rope[self.layer_types[layer_idx]]
            q_before_rope = q
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            # Attention reads every key and value back from the cache, this step's too.
            k, v = cache_dtype.round_trip(k), cache_dtype.round_trip(v)
            keys, values = cache[layer_idx]
            keys, values = torch.cat([keys, k], dim=1), torch.cat([values, v], dim=1)
            cache[layer_idx] = (keys, values)
            total = keys.shape[1]
            window = self.window[layer_idx]
            hidden = None
            if n > 1 or window is not None:
                # Query i sits at physical slot total - n + i and sees slots <= it.
                q_slot = (total - n + torch.arange(n)).view(-1, 1)
                visible = torch.arange(total).view(1, -1) <= q_slot
                if window is not None:  # never compressed: slots are logical positions
                    visible &= torch.arange(total).view(1, -1) > q_slot - window
                hidden = ~visible
            c = self.compressed.get(layer_idx)  # None: a sliding-window layer
            dead = state.dead_slots(c, total) if state is not None and c is not None else None
            sinks = self.sinks[layer_idx]
            attended, logits = dense_attention(q, keys, values, self.scale, hidden, dead, sinks)
            if self._on_logits is not None and c is not None:
                self._on_logits(c, logits, sinks)
            attended = attended.to(x.dtype).transpose(0, 1).reshape(n, -1)
            out = attn.o_proj(attended if gate is None else attended * torch.sigmoid(gate))
            if self.gemma:  # sandwich norms around attention and MLP
                x = x + layer.post_attention_layernorm(out)
                x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            else:
                x = x + out
                h = layer.post_attention_layernorm(x)
                # Routed experts take a batch dimension (gpt-oss's also return
                # the router's scores); a dense MLP the tokens as they are.
                if self.gpt_oss:
                    x = x + layer.mlp(h.unsqueeze(0))[0][0]
                else:
                    x = x + (layer.mlp(h.unsqueeze(0))[0] if hasattr(layer.mlp, "experts") else layer.mlp(h))
            if observed is not None and observed.any() and c is not None:
                if state.scorer.observe.scores_attention():
                    state.observe(c, logits[:, observed].float(), positions[observed], sinks)
                else:  # expected attention: the queries themselves, before RoPE
                    state.observe_queries(c, q_before_rope[:, observed].transpose(0, 1).float())
        x = m.norm(x[-1:])
        logits = self.model.lm_head(x)[0].float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _repeat_scores(self, prompt: list[int], cache, scorer, repeat_tokens, max_model_len: int | None,
                       cache_dtype: CacheDType) -> list[torch.Tensor | None]:
        """KVzip: per compressed layer [Hkv, len(prompt)] the scores of the
        prompt's repeat passes, each run over a copy of the prefilled cache
        (its own keys and values, and any recurrent state, then dropped).
        `repeat_tokens` None: from the model's own tokenizer."""
        from vllm_kvcompress.scorers.kvzip import RepeatTokens, repeat_passes, subsample_scores, subsample_slots

        if repeat_tokens is None:
            from transformers import AutoTokenizer

            repeat_tokens = RepeatTokens.of(AutoTokenizer.from_pretrained(self.model.name_or_path))
        group = self.num_q_heads // self.num_kv_heads
        scores: list[torch.Tensor | None] = [torch.zeros(self.num_kv_heads, len(prompt)) for _ in self.compressed]
        for rp in repeat_passes(prompt, scorer, repeat_tokens, max_model_len):
            slots = torch.arange(rp.context_len, rp.context_len + len(rp.tokens))
            keys = subsample_slots(rp, int(slots[-1]))

            def on_logits(c: int, logits: torch.Tensor, sinks, rp=rp, slots=slots, keys=keys) -> None:
                sink = None if sinks is None else sinks.float().view(self.num_kv_heads, group)
                subsample = logits[:, :, keys].reshape(self.num_kv_heads, group, len(slots), len(keys))
                chunk = subsample_scores(subsample, rp, slots, sink)
                layer = scores[c]
                assert layer is not None
                layer[:, rp.start: rp.end] = torch.maximum(layer[:, rp.start: rp.end], chunk)

            self._on_logits = on_logits
            try:
                self._forward(list(rp.tokens), slots, copy.deepcopy(cache), None, cache_dtype)
            finally:
                self._on_logits = None
        return scores

    def _physical_kv(self, cache, layer: int, c: int,
                     state: RequestTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, T, D] the layer's cached keys and values in physical order (what its scorer may read)."""
        return cache[layer]

    def _compact(self, cache, layer: int, keep: torch.Tensor) -> None:
        """Keep slots `keep` [Hkv, K] of the layer's dense cache, in order."""
        cache[layer] = tuple(gather_slots(x, keep) for x in cache[layer])

    def _copy_cache(self, cache):
        """A cache a later `generate` continues from (`resume`): each step
        replaces a layer's tensors, so the list is copied, not the tensors."""
        return list(cache)

    def _empty_cache(self):
        empty = torch.empty(self.num_kv_heads, 0, self.head_dim, dtype=self.model.dtype)
        if "linear_attention" not in self.layer_types:
            return [(empty, empty) for _ in range(self.num_layers)]
        from transformers import DynamicCache

        states = DynamicCache(config=self.model.config)  # the Gated DeltaNet layers' (HF keeps them per layer)
        return [states if t == "linear_attention" else (empty, empty) for t in self.layer_types]

    def _merge(self, cache, state: RequestTokens, merge, cache_dtype: CacheDType) -> None:
        """MiniCache over the compacted pairs: the lower layer keeps its stored
        (merged or exact) vectors; the upper layer's dense cache becomes what
        its attention reads, the restored vectors."""
        model_layer = {c: layer for layer, c in self.compressed.items()}
        for upper, lower in state.lower_of.items():
            (k_lo, v_lo), (k_up, v_up) = cache[model_layer[lower]], cache[model_layer[upper]]
            key, value = merge.merge_pair((k_lo, v_lo), (k_up, v_up))
            dtype = k_lo.dtype
            stored_k, stored_v = (cache_dtype.round_trip(x.lower.to(dtype)) for x in (key, value))
            retained_k, retained_v = (cache_dtype.round_trip(x.retained.to(dtype)) for x in (key, value))
            cache[model_layer[lower]] = (stored_k, stored_v)
            cache[model_layer[upper]] = (
                restore(stored_k, retained_k, key.slot, key.scale).to(dtype),
                restore(stored_v, retained_v, value.slot, value.scale).to(dtype))
            state.merged[upper] = MergedUpper.of(lower, key, value)

    # ------------------------------------------------------------ decoding

    def generate(
        self, prompt: list[int], max_new_tokens: int, config: KVCompressConfig | None = None,
        block_size: int = 32, kv_cache_dtype: str = "auto", forced: list[int] | None = None,
        resume: dict | None = None, repeat_tokens=None, max_model_len: int | None = None,
    ) -> dict:
        """Greedy tokens with the config's compression applied on the schedule's points (schedule.py),
        keys and values cached as vLLM caches them at `kv_cache_dtype` (auto, or an fp8 format).

        `forced`: decode these tokens instead of the greedy ones (another
        decoder's output, e.g. the engine's): "deficits" then says, per token,
        how far its logit falls below the best one here (0 where it is the
        greedy token). A 16-bit model's two decoders part at near ties; forced,
        every token of the other is checked, not only those before they part.

        `repeat_tokens` (`scorers.kvzip.RepeatTokens`; None: from the model's
        tokenizer), `max_model_len`: a KVzip request's repeat passes, as the
        engine's scheduler makes them.

        `resume`: an earlier `generate`'s result ("resume" in it): this prompt
        begins with that request's prompt and outputs (but the last, whose KV
        was never computed), and continues from its compressed cache and
        state as they were at its end (a conversation's next turn with
        `reuse`), computing only the tokens after them.

        Returns tokens, the kept logical positions per compressed layer at the end, the
        physical cache length after every compression and the logical length
        at which it happened, per layer the number of masked (per-head
        evicted) slots, and per token its logit's margin over the runner-up.
        """
        config = config or KVCompressConfig()
        cache_dtype = CacheDType(kv_cache_dtype)
        cache = self._empty_cache()
        # The engine's KV cache groups of compressed (full-attention) layers:
        # a group's layers share one length.
        num_compressed = len(self.compressed)
        group_of_layer = layer_groups(num_compressed, config.num_layer_groups)
        resolved = resolve_plan(config, len(prompt), num_compressed, block_size)
        plan = RequestSchedule.create(resolved, group_of_layer)
        state = None
        if resolved is not None:
            state = RequestTokens(resolved, num_compressed, self.num_kv_heads, self.num_q_heads, geometry=self.geometry)
        lengths: list = []
        compressed_at: list[int] = []  # logical length at each compression

        def compress_if_due(logical: int) -> None:
            targets = plan.next_compression(logical)
            if targets is None:
                return
            assert state is not None
            for layer, c in self.compressed.items():
                keep = state.select(c, targets[group_of_layer[c]], *self._physical_kv(cache, layer, c, state))
                self._compact(cache, layer, keep)
                state.keep_selected(c, keep)
            if state.lower_of and not state.merged:
                self._merge(cache, state, state.plan.merge, cache_dtype)
            state.finish_compaction()
            plan.commit(logical, targets)
            lengths.append(targets[0] if len(targets) == 1 else targets)
            compressed_at.append(logical)

        # The prompt in the chunks the schedule allows (one chunk unless the
        # trigger streams the prompt), each preceded by any eviction due.
        logical = 0
        if resume is not None:
            saved = resume["resume"]
            history = saved["history"]
            if len(history) >= len(prompt) or prompt[: len(history)] != history:
                raise ValueError("reference decoder: the prompt does not continue the resumed request")
            if state is None or saved["state"] is None:
                raise ValueError("reference decoder: resuming needs compression on both requests")
            cache = self._copy_cache(saved["cache"])
            plan.start_from(saved["num_evicted"])
            state.continue_from(saved["state"])
            logical = len(history)
        while logical < len(prompt):
            compress_if_due(logical)
            cap = plan.tokens_until_due(logical)
            end = len(prompt) if cap is None else min(len(prompt), logical + cap)
            if state is not None:
                state.next_due = plan.next_due(logical)
            logits = self._forward(prompt[logical:end], torch.arange(logical, end), cache, state, cache_dtype)
            logical = end
        if resolved is not None and resolved.scorer.reconstructs_context and resolved.compresses_prompt \
                and resume is None:  # a resumed state's tokens keep their scores (KVzip.score)
            assert state is not None
            state.take_repeat_scores(self._repeat_scores(prompt, cache, resolved.scorer, repeat_tokens, max_model_len,
                                                         cache_dtype))
        if plan.budgets_pending:  # the worker reports these at prefill end
            assert state is not None
            plan.set_layer_budgets(state.attention_budgets())
        tokens: list[int] = []
        margins: list[float] = []
        deficits: list[float] = []

        def take(logits: torch.Tensor) -> None:
            best = int(logits.argmax())
            token = best if forced is None else forced[len(tokens)]
            tokens.append(token)
            margins.append(_margin(logits))
            deficits.append(float(logits[best] - logits[token]))

        take(logits)
        while len(tokens) < max_new_tokens:
            logical = len(prompt) + len(tokens) - 1  # tokens whose KV is cached
            compress_if_due(logical)
            if state is not None:
                state.next_due = plan.next_due(logical)
            take(self._forward([tokens[-1]], torch.tensor([logical]), cache, state, cache_dtype))
        kept = [state.positions(i) for i in range(num_compressed)] if state else None
        # Per-head budgets: per layer, the kept slots some head does not attend.
        dead = [0 if d is None else int(d.sum()) for d in state.dead] if state else None
        history = prompt + tokens[:-1]  # the tokens whose KV is cached
        return {"tokens": tokens, "kept_positions": kept, "compressed_lengths": lengths,
                "compressed_at": compressed_at, "dead_slots": dead, "margins": margins, "deficits": deficits,
                "resume": {"history": history, "cache": self._copy_cache(cache), "state": state,
                           "num_evicted": tuple(plan.num_evicted)}}


def at_length(result: dict, length: int) -> dict:
    """A `generate` result's resumable state as it was at `length` tokens (its
    prompt, say): the newer tokens dropped from its cache's tail (they came
    after its last compression), as the engine keeps a prompt's state for
    `reuse`."""
    saved = result["resume"]
    drop = len(saved["history"]) - length
    cache = [(k[:, : k.shape[1] - drop], v[:, : v.shape[1] - drop]) for k, v in saved["cache"]]
    return {"resume": {"history": saved["history"][:length], "cache": cache,
                       "state": saved["state"].truncated(length), "num_evicted": saved["num_evicted"]}}


def gather_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [H, T, D] at slots [H, K] (per head) -> [H, K, D]."""
    return torch.gather(x, 1, slots.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    hidden: torch.Tensor | None, dead: torch.Tensor | None,
                    sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' attention, in float32 whatever the model's dtype (vLLM's
    CPU kernel computes attention in float32 on the stored values).

    q [Hq, n, D] over keys and values [Hkv, T, D] (query head h reads KV head
    h // G: the group's queries stacked as rows of one matmul per KV head);
    `hidden` (broadcasts to [Hq, n, T]) True where a query may not look; `dead`
    [Hkv, T] a head's evicted slots (per-head budgets); `sinks` [Hq] each
    head's sink logit in the denominator, with no value (gpt-oss). Returns the
    output [Hq, n, D] and the masked logits [Hq, n, T] a scorer observes."""
    hq, n, head_dim = q.shape
    hkv, total = keys.shape[:2]
    group = hq // hkv
    logits = (q.float().reshape(hkv, group * n, head_dim) @ keys.float().transpose(1, 2)).view(hq, n, total) * scale
    if hidden is not None:
        logits = logits.masked_fill(hidden, float("-inf"))
    if dead is not None:
        logits = logits.masked_fill(dead.repeat_interleave(group, dim=0).unsqueeze(1), float("-inf"))
    if sinks is None:
        probs = torch.softmax(logits, dim=-1)
    else:
        sink_column = sinks.float().view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([logits, sink_column], dim=-1), dim=-1)[..., :-1]
    out = (probs.reshape(hkv, group * n, total) @ values.float()).view(hq, n, head_dim)
    return out, logits


def _margin(logits: torch.Tensor) -> float:
    """How far the greedy token's logit is ahead of the next one's."""
    top = logits.topk(2).values
    return float(top[0] - top[1])
