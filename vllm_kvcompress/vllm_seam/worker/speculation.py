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

from typing import TYPE_CHECKING

import torch

from ...host_reads import upload
from ...token_state import RequestTokens, SpeculativeQueries

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
    to the scores one query at a time, in position order (a decode step's sum)."""
    ids = worker.runner.block_ids(rid)
    device = worker.device
    for layer, held in accepted.items():
        group = worker.group_of_layer[layer]
        # The tail is contiguous: a query's slot is its position less the layer's evictions.
        offset = state.logical_len - state.num_tokens(layer)
        widths = [int(p) - offset + 1 for p in held.logical]
        keys = worker.views(worker.layers[layer].kv_cache)[0]
        table = upload(torch.tensor(ids[worker.vllm_groups[group]], dtype=torch.int64), device)
        rows = len(widths)
        transform = None
        if state.noisy:
            noise = state.logits_noise(layer, upload(held.logical, device))
            assert noise is not None
            transform = ("gumbel", noise.noise.transpose(0, 1), noise.tau)
        scores = torch.zeros(rows, held.queries.shape[1], max(widths), dtype=torch.float32, device=device)
        worker.ops.accumulate_decode_scores(
            held.queries, keys, table.expand(rows, -1), upload(torch.tensor(widths, dtype=torch.int64), device),
            scores, worker.scales[layer], transform, max_seq_len=max(widths))
        for j, width in enumerate(widths):
            state.accumulate(layer, scores[j, :, :width])
