"""KVzip: score the prompt's tokens by the attention a pass that repeats the prompt pays them.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction" (2025), as kvpress's KVzipPress computes it. No question is
needed: once the prompt is prefilled, the model is asked to repeat it ("Repeat
the previous context exactly." and the chat template's turn to answer, then
the prompt itself), chunk by chunk (`chunk_size` prompt tokens per repeat
pass; a later chunk's instruction ends with the `overlap` tokens before it).
A repeat pass's queries attend the whole prompt and their own pass; a cached
token's score is the highest attention any query of the pass reconstructing
its chunk pays it, over that query's softmax of the first `sink_tokens`
tokens, the chunk and the pass's own tokens (kvpress's subsample), maximised
over the queries and a KV head's query heads. The first `sink_tokens` tokens
are kept. A repeat pass's keys, values and sampled token are thrown away.

In the engine a repeat pass is a request of its own that the scheduler starts
once the prompt is prefilled (its prompt: the prompt and the repeat, so the
prompt's blocks come from vLLM's prefix cache); the request takes its first
token from the prefill, waits for its passes, and compresses on their scores
before its second (vllm_seam/scheduler.py, worker/attention_passes.py
`RepeatScores`). The reference decoder runs the same passes over a copy of
its dense cache. The scores stay with the kept tokens: a request continuing a
saved state (`reuse`) runs no pass, keeps its own new tokens first and
evicts the state's by their scores (`KVzip.score`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ..compat import Problem, first_problem
from ..limits import bounded
from .base import Observation, Observe, Scorer, check_at_least

if TYPE_CHECKING:
    from ..config import KVCompressConfig
    from ..registry import Components

# kvpress's instructions (KVzipPress.prepare).
FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
NEXT_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class KVzip(Scorer):
    name = "kvzip"
    # The request's own queries: none. Its repeat passes' are scored apart
    # (`RepeatPass`), and the request's scores are theirs.
    observe = Observe.NOTHING
    reconstructs_context: ClassVar[bool] = True

    sink_tokens: int = field(default=4, metadata=bounded(
        0, "tokens", help="first tokens always kept (attention sinks), in every repeat pass's softmax"))
    chunk_size: int = field(default=2048, metadata=bounded(
        1, "tokens", help="kvzip: prompt tokens one repeat pass reconstructs (fewer where max_model_len "
                          "leaves less room beside the prompt)"))
    overlap: int = field(default=8, metadata=bounded(
        0, "tokens", help="kvzip: the tokens before a chunk that its repeat pass's instruction ends with"))

    def validate(self) -> None:
        check_at_least("sink_tokens", self.sink_tokens, 0)
        check_at_least("chunk_size", self.chunk_size, 1)
        check_at_least("overlap", self.overlap, 0)

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        problem = super().incompatible_with(parts, config)
        return problem or first_problem(
            (parts.trigger.name != "once", "trigger",
             f"scorer 'kvzip' reconstructs the prompt once, after its prefill; valid with it: ['once'], "
             f"got {parts.trigger.name!r}"),
            (parts.allocation.from_attention and bool(config.reuse), "reuse",
             f"allocation {parts.allocation.name!r} shares a KVzip request's budget by its repeat passes' "
             f"scores, and a request continuing a saved state runs none; valid with it: false (or allocation "
             f"'pyramid', 'retrieval', 'uniform')"),
            (parts.merge.name != "none", "merge",
             f"scorer 'kvzip' is not composed with merge {parts.merge.name!r}; valid with it: ['none']"))

    def protected(self, budget: int) -> tuple[int, int]:
        return self.sink_tokens, 0

    def min_budget(self) -> int:
        return self.sink_tokens + 1

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.attention is None or obs.scored_len == 0:
            raise RuntimeError(f"kv_compress: kvzip has no repeat-pass scores for layer {obs.layer}")
        # Each query head holds its KV head's scores (`RequestTokens.take_repeat_scores`).
        scores = obs.attention.view(obs.num_kv_heads, -1, obs.attention.shape[-1]).amax(dim=1)
        # Tokens after the repeated prompt (a request continuing a saved
        # state, `reuse`: its own new tokens, never repeated) are kept before
        # any repeated one (scores are probabilities, at most 1), the newest first.
        unscored = obs.positions >= obs.scored_len
        return torch.where(unscored, 2.0 + obs.positions.to(torch.float32), scores)


@dataclass(frozen=True)
class RepeatTokens:
    """The token ids around a repeated chunk: the first pass's instruction,
    the later passes', and what the chat template puts between a user's turn
    and the answer."""

    first: tuple[int, ...]
    next: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> RepeatTokens:
        """From a Hugging Face tokenizer, as kvpress derives them."""
        suffix_text = "\n"  # a model without a chat template
        if getattr(tokenizer, "chat_template", None) is not None:
            context = "dummy context"
            separator = "\n" + "#" * len(context)
            text = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                                 add_generation_prompt=True, tokenize=False, enable_thinking=False)
            suffix_text = text.split(separator)[1]

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(encode(FIRST_INSTRUCTION), encode(NEXT_INSTRUCTION), encode(suffix_text))


@dataclass(frozen=True)
class RepeatPass:
    """One repeat pass of a request's prompt: its tokens follow the prompt's
    `context_len`, and its queries score the chunk [start, end)."""

    context_len: int
    start: int
    end: int
    sink_tokens: int
    tokens: tuple[int, ...]  # the pass's own tokens (instruction, suffix, chunk)

    @property
    def sinks(self) -> int:
        """The leading tokens in this pass's softmax beside its chunk."""
        return min(self.sink_tokens, self.start)


def repeat_passes(context: Sequence[int], scorer: KVzip, tokens: RepeatTokens,
                  max_len: int | None = None) -> list[RepeatPass]:
    """The repeat passes that score `context`: one per chunk, each short
    enough that the context, the pass and the one token it samples fit
    `max_len` tokens (None: no limit; vLLM fails a step whose sampled token
    passes max_model_len). Raises ValueError where no chunk fits."""
    n = len(context)
    extra = max(len(tokens.first), len(tokens.next) + scorer.overlap) + len(tokens.suffix)
    chunk = scorer.chunk_size if max_len is None else min(scorer.chunk_size, max_len - n - extra - 1)
    if chunk < 1:
        raise ValueError(f"kvzip: a prompt of {n} tokens leaves no room for a repeat pass of it within "
                         f"max_model_len {max_len} (the pass takes {extra} tokens and a chunk of the prompt); "
                         f"raise max_model_len")
    passes = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        # A later pass's instruction ends with the previous chunk's last `overlap` tokens (kvpress's postfix).
        head = tokens.first if start == 0 else tokens.next + tuple(context[start - min(scorer.overlap, chunk): start])
        passes.append(RepeatPass(n, start, end, scorer.sink_tokens, (*head, *tokens.suffix, *context[start:end])))
    return passes


def subsample_scores(logits: torch.Tensor, rp: RepeatPass, q_slots: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A repeat pass's queries' scores of its chunk: `logits` [Hkv, G, n, K]
    of n queries (at slots `q_slots` [n] of the request's context and pass)
    over the keys `subsample_slots(rp, last)` lists; `sinks` [Hkv, G] (a
    model's learned sink logit per query head, None: none) in each softmax's
    denominator. Returns [Hkv, end - start]: the
    highest probability a query of the pass gives each chunk token, over the
    queries and the KV head's query heads. Only the chunk's probabilities are
    formed (from each row's log-sum-exp); `logits` is overwritten (masked)."""
    head = rp.sinks + rp.end - rp.start  # the sinks and the chunk: every query sees them all
    own = torch.arange(logits.shape[-1] - head, device=logits.device) + rp.context_len
    hidden = own[None, :] > q_slots[:, None]  # [n, own]: a pass's query sees its own tokens up to itself
    logits[..., head:].masked_fill_(hidden, float("-inf"))
    norm = torch.logsumexp(logits, dim=-1)
    if sinks is not None:
        norm = torch.logaddexp(norm, sinks.to(norm.dtype).unsqueeze(-1).expand_as(norm))
    probs = torch.exp(logits[..., rp.sinks: head] - norm.unsqueeze(-1))
    return probs.amax(dim=(1, 2))


def subsample_slots(rp: RepeatPass, last: int, device=None) -> torch.Tensor:
    """The slots whose keys a repeat pass's softmax holds, for queries up to
    slot `last`: the sinks, the chunk, the pass's own tokens to `last`."""
    return torch.cat([torch.arange(rp.sinks, device=device), torch.arange(rp.start, rp.end, device=device),
                      torch.arange(rp.context_len, last + 1, device=device)])


# Scratch bound of the engine's repeat scores: elements of one piece's [Hq, n, K] logits.
_REPEAT_ELEMENTS = 1 << 24


def paged_repeat_scores(query: torch.Tensor, key_cache: torch.Tensor, block_ids: torch.Tensor,
                        q_slots: torch.Tensor, last: int, rp: RepeatPass, scale: float,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's side of `subsample_scores`: a repeat pass's queries of
    one step `query` [n, Hq, D] at slots `q_slots` [n] (the last: `last`, on
    the host) over its request's paged `key_cache` (block ids `block_ids`;
    its slots are its logical positions: a repeat pass evicts nothing).
    Returns [Hkv, end - start] float32, the queries taken in pieces of a
    bounded size (a maximum joins them)."""
    from ..kernels.torch_paged import gather_dense

    n, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    slots = subsample_slots(rp, last, key_cache.device)
    keys = gather_dense(key_cache, block_ids, last + 1)[:, slots].to(torch.float32)  # [Hkv, K, D]
    keys_t = keys.transpose(-1, -2).contiguous()  # [Hkv, D, K]: one batched matmul per piece
    sink = None if sinks is None else sinks.view(num_kv_heads, group)
    # [Hkv, G, n, D], scaled once.
    q = (query.to(torch.float32) * scale).view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    piece = max(1, _REPEAT_ELEMENTS // (num_q_heads * len(slots)))
    best: torch.Tensor | None = None
    for i in range(0, n, piece):
        rows = q[:, :, i: i + piece]
        m = rows.shape[2]
        logits = torch.bmm(rows.reshape(num_kv_heads, group * m, head_dim), keys_t).view(num_kv_heads, group, m, -1)
        scores = subsample_scores(logits, rp, q_slots[i: i + piece], sink)
        best = scores if best is None else torch.maximum(best, scores)
    assert best is not None, "a repeat pass's step has queries"
    return best
