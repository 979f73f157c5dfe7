"""Speculative decoding: what a step that verifies drafts leaves to the next one.

vLLM's proposer (n-gram lookup) drafts tokens from the request's own text;
one step computes the last sampled token and the drafts together, and the
sampler keeps the drafts up to the first one the model disagrees with. The
drafts' keys and values go to the cache like any token's (at physical slots,
step_inputs.py), and the next step writes over the rejected ones' slots.
The plugin's part is what its scorers observe: a rejected draft's query must
never be scored, and an accepted one must be scored as decoding it alone
would have (one query a step, in order, over the keys up to its own slot).

So the observed queries of a verifying step are held (attention_passes.
HeldQueries) and, at the start of the next step, once the scheduler says how
many tokens the request now has (`StepPlan.settled`), the rejected tokens
leave the request's tail and the accepted queries are scored one row each
(`settle_requests`), before that step's compactions read the scores. No
compression falls inside a verifying step: the scheduler ends a step where
the request's next compression is due, drafts included (as prompt chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...host_reads import upload
from ...token_state import RequestTokens, SpeculativeQueries
from ..groups import layer_index

if TYPE_CHECKING:
    from .state import WorkerCompression


def settle_requests(worker: WorkerCompression, settled: dict[str, int]) -> None:
    """Requests whose last step verified drafts now hold `settled[rid]` tokens:
    drop the rejected ones, score the accepted ones' held queries."""
    for rid, logical_len in settled.items():
        state = worker.states.get(rid)
        if state is None or state.logical_len == 0:  # ended, or (re)started in this step
            continue
        with worker.isolated(rid, "settling speculative tokens"):
            accepted = state.settle(logical_len)
            if accepted:
                with worker.timer.phase("scoring"):
                    _score_accepted(worker, rid, state, accepted)


def _score_accepted(worker: WorkerCompression, rid: str, state: RequestTokens,
                    accepted: dict[int, SpeculativeQueries]) -> None:
    """Each accepted query's attention over the keys up to its own slot, added
    to the scores one query at a time, in position order (a decode step's sum);
    or, for a scorer of the queries themselves, the queries added to its moments."""
    ids = worker.runner.block_ids(rid)
    device = worker.device
    tables: dict[int, torch.Tensor] = {}  # one upload per KV cache group
    for layer, held in accepted.items():
        if not state.scorer.observe.scores_attention():  # expected attention: the queries themselves
            assert worker.geometry is not None  # a request without it fails at its start
            state.observe_queries(layer, worker.geometry.unrotated(held.queries, upload(held.logical, device)))
            continue
        group = worker.group_of_layer[layer]
        # The tail is contiguous: a query's slot is its position less the layer's evictions.
        offset = state.logical_len - state.num_tokens(layer)
        widths = [int(p) - offset + 1 for p in held.logical]
        keys = worker.views(worker.layers[layer].kv_cache)[0]
        if group not in tables:
            tables[group] = upload(torch.tensor(ids[worker.vllm_groups[group]], dtype=torch.int64), device)
        table = tables[group]
        rows = len(widths)
        transform = None
        if state.noisy:
            noise = state.logits_noise(layer, upload(held.logical, device))
            assert noise is not None
            transform = ("gumbel", noise.noise.transpose(0, 1), noise.tau)
        scores = torch.zeros(rows, held.queries.shape[1], max(widths), dtype=torch.float32, device=device)
        worker.ops.accumulate_decode_scores(
            held.queries, keys, table.expand(rows, -1), upload(torch.tensor(widths, dtype=torch.int64), device),
            scores, worker.scales[layer], transform, max_seq_len=max(widths), sinks=worker.sinks[layer])
        for j, width in enumerate(widths):
            state.accumulate(layer, scores[j, :, :width])


# ---------------------------------------------------------------- a draft model's cache
#
# vLLM's draft-model proposer puts the draft's attention layers in the
# target's first KV cache group: the same blocks, the same block table, the
# same metadata (V1's seq_lens there are that group's physical lengths). So
# its cache is compressed with the target's kept positions: a draft layer
# follows one target layer of that group, each of its KV heads one of that
# layer's heads, and moves when it moves (compaction.py). Its own queries are
# never observed. The draft only proposes and the target verifies every
# token, so what the draft's cache keeps can change the acceptance rate,
# never the tokens; what it must never do is write outside the request's own
# blocks (another group's layers share the memory): its slots are physical,
# and those past the request's blocks are not written.


@dataclass(frozen=True)
class DraftLayer:
    """One attention layer of the draft model and the target layer it follows."""

    module: Any  # the draft's attention layer (its `kv_cache`)
    follows: int  # compressed layer index (in the group the draft shares)
    heads: torch.Tensor | None  # draft KV head -> followed KV head (None: one to one)


def draft_layers(draft_modules: dict[str, Any], layers: list, group_of_layer: list[int],
                 group: int, device: torch.device | str = "cpu") -> list[DraftLayer]:
    """The draft's layers (name -> module, in model order), each following a
    compressed layer of `group` (compressed index), spread evenly: a draft
    as deep as the target follows it layer by layer. The head maps live on
    `device` (the cache's), where compaction indexes with them."""
    if not draft_modules:
        return []
    candidates = [i for i, g in enumerate(group_of_layer) if g == group]
    names = sorted(draft_modules, key=layer_index)
    result = []
    for d, name in enumerate(names):
        module = draft_modules[name]
        follows = candidates[d * len(candidates) // len(names)]
        h_draft, h_target = module.num_kv_heads, layers[follows].num_kv_heads
        heads = None if h_draft == h_target else torch.arange(h_draft, device=device) * h_target // h_draft
        result.append(DraftLayer(module, follows, heads))
    return result


@dataclass(frozen=True)
class DraftSlots:
    """Where the draft writes in this step: per request (batch order) the
    tokens its group has evicted (logical - physical) and the slots its blocks hold."""

    evicted: torch.Tensor  # [R] int64, on the cache's device
    capacity: torch.Tensor  # [R] int64
    evicted_host: torch.Tensor  # [R] int64, the same on the host (MRV2's length bounds)


def physical_draft_slots(slots: DraftSlots, positions: torch.Tensor, request_of: torch.Tensor,
                         block_table: torch.Tensor, block_size: int, vllm_slots: torch.Tensor) -> torch.Tensor:
    """The draft's slot mapping for tokens at logical `positions` of requests
    `request_of` (batch rows): vLLM's `vllm_slots` read the block table at
    the logical position; a compressed request's token goes where its
    physical position is. Padding (-1, vLLM's rejected or too-long tokens)
    stays, and so does anything past the request's blocks."""
    physical = positions.to(torch.int64) - slots.evicted[request_of]
    inside = (vllm_slots >= 0) & (physical >= 0) & (physical < slots.capacity[request_of])
    physical = torch.where(inside, physical, 0)
    blocks = block_table[request_of, physical // block_size].to(torch.int64)
    return torch.where(inside, blocks * block_size + physical % block_size, -1).to(vllm_slots.dtype)


# ---------------------------------------------------------------- Model Runner V2's draft metadata


def draft_metadata(cm: Any, slots: DraftSlots) -> Any:
    """The draft's CommonAttentionMetadata with physical lengths: its
    requests' seq_lens less what the target's group 0 evicted (a copy)."""
    num_reqs = len(slots.evicted)
    seq_lens = cm.seq_lens.clone()
    seq_lens[:num_reqs] -= slots.evicted.to(seq_lens.device, seq_lens.dtype)
    upper = cm.seq_lens_cpu_upper_bound
    if upper is not None:
        upper = upper.clone()
        upper[:num_reqs] -= slots.evicted_host.to(upper.dtype)
    return cm.replace(seq_lens=seq_lens, seq_lens_cpu_upper_bound=upper, _num_computed_tokens_cache=None)
