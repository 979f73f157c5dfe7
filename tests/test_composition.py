"""Every scorer under every budget allocation, trigger and selection modifier, without an engine.

For each composition the configuration allows, a request is driven through
the schedule (when to compress) and `RequestTokens` (which tokens) over a
prompt and a decode, with synthetic attention; at every compaction the kept
positions are compared with a plain re-implementation of methods.md's math
written below (loops, no shared helpers), and the compaction schedule with
the trigger's rule. The compositions the configuration refuses are exactly
the ones that cannot be served.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from helpers import plain_head_counts
from vllm_kvcompress.budgets import ALLOCATIONS
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.schedule import RequestSchedule, layer_groups
from vllm_kvcompress.scorers import SCORERS, hash_uniform
from vllm_kvcompress.scorers.expected_attention import QueryGeometry
from vllm_kvcompress.scorers.knorm import NORM_DECIMALS
from vllm_kvcompress.selection import SELECTIONS
from vllm_kvcompress.token_state import RequestTokens
from vllm_kvcompress.triggers import TRIGGERS

NUM_LAYERS, HKV, GROUP = 2, 2, 2
HQ = HKV * GROUP
PROMPT, DECODE, BUDGET, INTERVAL, CHUNK = 120, 70, 48, 16, 32
DECODE_WINDOW = 24  # trigger once_window: the generated tokens kept
BLOCK = 32
# Small protected windows so that scores decide most of the budget.
SCORER_PARAMS = {
    "snapkv": {"window": 8, "kernel_size": 5},
    "h2o": {"recent_ratio": 0.25},
    "tova": {"window": 4},
    "keyformer": {"window": 8},
    "streamingllm": {"sink_tokens": 4},
    "random": {"window": 4, "seed": 3},
    "rkv": {"window": 4, "kernel_size": 3, "mix_lambda": 0.5, "threshold": 0.3},
    "knorm": {},
    "expected_attention": {"sink_tokens": 4, "future_positions": 24},
    "kvzip": {"sink_tokens": 4},
}
ATTENTION_SCORERS = {"snapkv", "h2o", "tova", "keyformer", "rkv"}
QUERY_SCORERS = {"expected_attention"}  # it observes the queries themselves
REPEAT_SCORERS = {"kvzip"}  # scored by passes that repeat the prompt (synthetic scores here: `repeat_scores`)
KEY_DIM = 4  # synthetic cached keys (R-KV's redundancy), values and queries (expected attention)
ROPE_BASE = 100.0  # the synthetic model's RoPE over all KEY_DIM dimensions (NeoX layout)
SPAN, CHUNK_LENGTH = 5, 6
# Allocation retrieval's profile: layer scores 0.3 and 0.9.
PROFILE = str(Path(__file__).parent / "data" / "retrieval-profile-2-layers.json")


def config_for(scorer: str, allocation: str, trigger: str, selection: str) -> dict:
    data = {"policy": scorer, "allocation": allocation, "trigger": trigger, "selection": selection,
            "budget": BUDGET, "interval": INTERVAL, "layer_groups": NUM_LAYERS, **SCORER_PARAMS[scorer]}
    if trigger == "streamed":
        data["prompt_chunk"] = CHUNK
    if trigger == "once_window":
        data["decode_window"] = DECODE_WINDOW
    if selection == "span":
        data["span"] = SPAN
    if selection == "chunk":
        data["chunk_length"] = CHUNK_LENGTH
    if allocation == "retrieval":
        data["profile"] = PROFILE
    return data


def refusal(scorer: str, allocation: str, trigger: str, selection: str) -> str | None:
    """The field a combination that cannot be served is refused on (None: served)."""
    if scorer in REPEAT_SCORERS and trigger != "once":
        return "trigger"  # it repeats the prompt once, after its prefill (its own check, first)
    if allocation == "per_head" and scorer in QUERY_SCORERS:
        return "allocation"  # head budgets are derived before the keys are read (the scorer's check, first)
    if trigger == "streamed" and scorer in QUERY_SCORERS:
        return "trigger"  # a later query could change its choice (the trigger's check, before the allocation's)
    if allocation in ("adaptive", "per_head") and scorer not in ATTENTION_SCORERS | REPEAT_SCORERS:
        return "allocation"  # budgets from attention, and the scorer observes no attention (KVzip: its passes')
    if allocation == "per_head" and scorer == "rkv":
        return "allocation"  # head budgets are derived before the keys are read
    if allocation == "per_head" and scorer == "tova":
        return "allocation"  # TOVA scores every head alike: one selection per layer
    if allocation == "per_head" and trigger != "once":
        return "trigger"  # per-head masks are derived once
    if allocation == "per_head" and selection == "chunk":
        return "selection"  # chunk ranks are per head; per-head budgets compare heads
    if trigger == "streamed" and scorer in ATTENTION_SCORERS:
        return "trigger"  # a later prompt query could change the choice
    if trigger == "decode" and scorer == "snapkv":
        return "trigger"  # it observes only prompt queries, and the prompt is kept whole
    if trigger == "decode" and allocation == "adaptive":
        return "allocation"  # budgets from the prompt's attention, and the prompt is kept whole
    return None


# Evicting scorers (keep_all only serves policy minicache: tests/test_minicache.py).
EVICTING = sorted(name for name, cls in SCORERS.items() if name != "keep_all")
COMBINATIONS = list(itertools.product(EVICTING, sorted(ALLOCATIONS), sorted(TRIGGERS), sorted(SELECTIONS)))


@pytest.mark.parametrize("scorer, allocation, trigger, selection", COMBINATIONS)
def test_configuration_serves_exactly_the_sound_combinations(scorer, allocation, trigger, selection):
    field = refusal(scorer, allocation, trigger, selection)
    if field is None:
        KVCompressConfig.from_dict(config_for(scorer, allocation, trigger, selection))
    else:
        with pytest.raises(KVCompressConfigError, match=f"kv_compress.{field}: "):
            KVCompressConfig.from_dict(config_for(scorer, allocation, trigger, selection))


# ---------------------------------------------------------------- the plain re-implementation


def attention_rows(step: int, length: int) -> torch.Tensor:
    """Synthetic attention of step `step`'s query heads to positions 0..length-1
    ([HQ, length], float64; peaked, no ties). Computed once per step and layer
    for both sides: it is the input, not the math under test."""
    q_head = torch.arange(HQ, dtype=torch.float64)[:, None]
    position = torch.arange(length, dtype=torch.float64)[None, :]
    return (torch.sin(step * 12.9898 + q_head * 78.233 + position * 37.719) * 43758.5453 % 1.0) ** 3


def key_vector(layer: int, kv_head: int, position: int) -> list[float]:
    """Synthetic cached key of a token (R-KV reads keys): fixed per (layer, head, position)."""
    return [math.sin(layer * 3.1 + kv_head * 7.7 + position * (0.37 + 0.11 * d) + d) for d in range(KEY_DIM)]


def value_vector(layer: int, kv_head: int, position: int) -> list[float]:
    """Synthetic cached value of a token (expected attention reads values)."""
    return [math.cos(layer * 2.3 + kv_head * 5.1 + position * (0.29 + 0.07 * d) - d) for d in range(KEY_DIM)]


def query_vector(step: int, layer: int, q_head: int) -> list[float]:
    """Synthetic query before RoPE of an observed step (expected attention)."""
    return [math.cos(step * 0.7 + layer * 1.3 + q_head * 2.9 + d * 0.5) * (1 + 0.3 * d) + 0.2 * d
            for d in range(KEY_DIM)]


def rope_angles(position: float) -> list[float]:
    return [position / ROPE_BASE ** (2 * i / KEY_DIM) for i in range(KEY_DIM // 2)]


def _cos_sin(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.tensor([rope_angles(float(p)) for p in positions.tolist()], dtype=torch.float64)
    return angles.cos().float(), angles.sin().float()


GEOMETRY = QueryGeometry(cos_sin=_cos_sin, max_position=4096, scale=KEY_DIM ** -0.5)


def naive_expected_attention(layer: int, kv_head: int, positions: list[int], queries: list[list[list[float]]],
                             logical_len: int) -> list[float]:
    """Expected attention (docs/policies.md): per query head of the KV head's
    group, the observed queries' mean and covariance turned by RoPE's rotation
    matrices averaged over the next `future_positions` positions; a softmax
    over the non-sink tokens of s mu.k + s^2 k^T Sigma k / 2; the group's
    mean times ||v||; sinks get the highest score."""
    params = SCORER_PARAMS["expected_attention"]
    sinks, future, d, half, scale = params["sink_tokens"], params["future_positions"], KEY_DIM, KEY_DIM // 2, \
        KEY_DIM ** -0.5
    turn = [[0.0] * d for _ in range(d)]  # the averaged rotation matrix
    for f in range(logical_len, logical_len + future):
        for i, a in enumerate(rope_angles(f)):
            turn[i][i] += math.cos(a) / future
            turn[i + half][i + half] += math.cos(a) / future
            turn[i][i + half] -= math.sin(a) / future
            turn[i + half][i] += math.sin(a) / future
    scores = [0.0] * len(positions)
    for q_head in range(kv_head * GROUP, (kv_head + 1) * GROUP):
        rows = [q[q_head] for q in queries]
        mean = [sum(r[i] for r in rows) / len(rows) for i in range(d)]
        cov = [[sum((r[i] - mean[i]) * (r[j] - mean[j]) for r in rows) / len(rows) for j in range(d)]
               for i in range(d)]
        mu = [sum(turn[i][a] * mean[a] for a in range(d)) for i in range(d)]
        sigma = [[sum(turn[i][a] * cov[a][b] * turn[j][b] for a in range(d) for b in range(d)) for j in range(d)]
                 for i in range(d)]
        logits = {}
        for p in positions:
            if p >= sinks:
                k = key_vector(layer, kv_head, p)
                logits[p] = scale * sum(m * x for m, x in zip(mu, k)) + scale * scale / 2 * sum(
                    k[i] * sigma[i][j] * k[j] for i in range(d) for j in range(d))
        top = max(logits.values())
        total = sum(math.exp(v - top) for v in logits.values())
        for i, p in enumerate(positions):
            if p >= sinks:
                scores[i] += math.exp(logits[p] - top) / total / GROUP
    scores = [s * math.sqrt(sum(x * x for x in value_vector(layer, kv_head, p))) for s, p in zip(scores, positions)]
    best = max(s for s, p in zip(scores, positions) if p >= sinks)
    return [best if p < sinks else s for s, p in zip(scores, positions)]


def naive_redundancy(layer: int, kv_head: int, candidates: list[int], threshold: float) -> dict[int, float]:
    """R-KV: per candidate, softmax over candidates of the mean cosine similarity to
    the others, each token's most recent near-duplicate forgotten."""
    unit = {}
    for p in candidates:
        k = key_vector(layer, kv_head, p)
        norm = math.sqrt(sum(x * x for x in k)) + 1e-8
        unit[p] = [x / norm for x in k]
    sim = {(i, j): 0.0 if i == j else sum(a * b for a, b in zip(unit[i], unit[j]))
           for i in candidates for j in candidates}
    for i in candidates:
        duplicates = [j for j in candidates if sim[i, j] > threshold]
        if duplicates:
            sim[i, max(duplicates)] = 0.0
    mean = {j: sum(sim[i, j] for i in candidates) / len(candidates) for j in candidates}
    top = max(mean.values())
    total = sum(math.exp(v - top) for v in mean.values())
    return {j: math.exp(v - top) / total for j, v in mean.items()}


def group_mean(values: list[list[float]]) -> list[float]:
    return [sum(v[i] for v in values) / len(values) for i in range(len(values[0]))]


def repeat_scores(layer: int) -> torch.Tensor:
    """Synthetic scores of the prompt's repeat passes (KVzip), [HKV, PROMPT]
    by logical position: the input, not the math under test."""
    return attention_rows(5000 + layer, PROMPT)[:HKV].float()


def naive_scores(scorer: str, kv_head: int, layer: int, positions: list[int], attention: dict,
                 num_compressions: int, protected_len: int = 0, queries: list | None = None,
                 logical_len: int = 0) -> list[float]:
    """methods.md's score of each cached token of one KV head (positions in cache order)."""
    params = SCORER_PARAMS[scorer]
    if scorer == "expected_attention":
        assert queries is not None
        return naive_expected_attention(layer, kv_head, positions, queries, logical_len)
    if scorer == "streamingllm":
        return [float(p) for p in positions]
    if scorer == "kvzip":  # the passes' score; a token after the repeated prompt: kept first, the newest first
        scored = repeat_scores(layer)[kv_head].tolist()
        return [scored[p] if p < PROMPT else 2.0 + p for p in positions]
    if scorer == "random":  # the hash itself is the definition (tested in test_core)
        return hash_uniform(params["seed"], torch.tensor(layer), torch.tensor(num_compressions),
                            torch.tensor(kv_head), torch.tensor(positions)).tolist()
    if scorer == "knorm":  # the key's L2 norm, negated, rounded (ties are ties): the smallest norms are kept
        return [-round(math.sqrt(sum(x * x for x in key_vector(layer, kv_head, p))), NORM_DECIMALS)
                for p in positions]
    # TOVA: all query heads of the layer (one selection); the others: the KV head's group.
    heads = range(HQ) if scorer == "tova" else range(kv_head * GROUP, (kv_head + 1) * GROUP)
    scores = group_mean([[attention.get((q, p), 0.0) for p in positions] for q in heads])
    if scorer == "snapkv":  # average pooling (zero padding) over the prefix before the window
        k, prefix = params["kernel_size"], len(positions) - params["window"]
        pooled = [sum(scores[j] for j in range(i - k // 2, i + k // 2 + 1) if 0 <= j < prefix) / k
                  for i in range(prefix)]
        scores = pooled + scores[prefix:]
    if scorer == "rkv":  # lambda * (window mean, max-pooled before the window) - (1 - lambda) * redundancy
        k, prefix, lam = params["kernel_size"], len(positions) - params["window"], params["mix_lambda"]
        mean = [s / params["window"] for s in scores]
        pooled = [max(mean[j] for j in range(i - k // 2, i + k // 2 + 1) if 0 <= j < prefix) for i in range(prefix)]
        importance = pooled + mean[prefix:]
        candidates = [p for p in positions if p >= protected_len]
        redundancy = naive_redundancy(layer, kv_head, candidates, params["threshold"]) if candidates else {}
        scores = [lam * imp - (1 - lam) * redundancy.get(p, 0.0) for imp, p in zip(importance, positions)]
    return scores


def naive_protected(scorer: str, budget: int) -> tuple[int, int]:
    params = SCORER_PARAMS[scorer]
    if scorer == "streamingllm":
        return params["sink_tokens"], budget - params["sink_tokens"]
    if scorer == "h2o":
        return 0, int(budget * params["recent_ratio"])
    if scorer in ("expected_attention", "kvzip"):
        return params["sink_tokens"], 0
    return 0, params.get("window", 0)


def naive_ranked(scorer, selection, kv_head, layer, positions, attention, num_compressions, budget,
                 protected_len: int = 0, protection: tuple[int, int] | None = None, queries: list | None = None,
                 logical_len: int = 0) -> list[float]:
    """What the top-k ranks, for `positions` in logical order: protected tokens first (inf).

    `budget` counts the tokens after the protected start (`protected_len`);
    `protection`: (sinks, recent) instead of the scorer's (a trigger's own)."""
    scores = naive_scores(scorer, kv_head, layer, positions, attention, num_compressions, protected_len,
                          queries, logical_len)
    sinks, recent = protection or naive_protected(scorer, budget)
    sinks = max(sinks, protected_len)
    newest = sorted(positions)[-recent:] if recent else []
    protected = [p < sinks or p in newest for p in positions]
    if selection == "span":  # the largest unprotected score among a token and the SPAN - 1 before it
        sources = [-math.inf if prot else s for s, prot in zip(scores, protected)]
        scores = [max(sources[max(0, i - SPAN + 1): i + 1]) for i in range(len(scores))]
    if selection == "chunk":  # whole chunks by summed score, earlier chunks first on ties
        free = [i for i, prot in enumerate(protected) if not prot]
        chunks = [free[c: c + CHUNK_LENGTH] for c in range(0, len(free), CHUNK_LENGTH)]
        ranked_chunks = sorted(range(len(chunks)), key=lambda c: -sum(scores[i] for i in chunks[c]))
        order = [i for c in ranked_chunks for i in chunks[c]]
        scores = [0.0] * len(scores)
        for rank, i in enumerate(order):
            scores[i] = float(len(order) - rank)
    return [math.inf if prot else s for s, prot in zip(scores, protected)]


def assert_top(got: set[int], ranked: list[float], positions: list[int], count: int, where) -> None:
    """`got` is a top-`count` set of `positions` by `ranked` (any choice among equal scores)."""
    score = dict(zip(positions, ranked))
    assert len(got) == min(count, len(positions)) and got <= set(score), where
    rest = [score[p] for p in positions if p not in got]
    if rest:
        assert min(score[p] for p in got) >= max(rest), where


def min_budget(scorer: str) -> int:
    params = SCORER_PARAMS[scorer]
    if scorer == "snapkv":
        return params["window"]
    if scorer in ("streamingllm", "expected_attention", "kvzip"):
        return params["sink_tokens"] + 1
    if scorer == "h2o":
        return 1
    return max(params.get("window", 0), 1)


def naive_layer_keeps(allocation: str, scorer: str, attention_per_layer: list[dict], positions,
                      compressible: int | None = PROMPT) -> list[int]:
    """Tokens each layer keeps beyond the protected start (`compressible`: the
    prompt tokens that may be compressed; None: the prompt is kept whole)."""
    w = min_budget(scorer)
    if allocation == "pyramid":  # KVCache-Factory, beta 20
        lo = (BUDGET - w) // 20
        hi = 2 * (BUDGET - w) - lo
        if compressible is not None and hi >= compressible - w:
            hi, lo = compressible - w, 2 * (BUDGET - w) - (compressible - w)
        step = (hi - lo) // (NUM_LAYERS - 1)
        return [hi - layer * step + w for layer in range(NUM_LAYERS)]
    if allocation == "adaptive":  # tokens holding 90% of each query head's attention, averaged
        needs = []
        for att in attention_per_layer:
            per_head = []
            for q in range(HQ):
                row = sorted((att.get((q, p), 0.0) for p in positions), reverse=True)
                total, acc, n = sum(row), 0.0, 0
                while acc < 0.9 * total:
                    acc += row[n]
                    n += 1
                per_head.append(max(n, 1))
            needs.append(sum(per_head) / HQ)
        return [max(w, int(BUDGET * NUM_LAYERS * need / sum(needs))) for need in needs]
    if allocation == "retrieval":  # share 0.5 of what is beyond the window follows layer scores 0.3 : 0.9
        extra = BUDGET - w
        wants = [extra / 2 + extra * NUM_LAYERS / 2 * s / 1.2 for s in (0.3, 0.9)]
        assert compressible is None or max(wants) <= compressible - w  # no cap at these sizes
        return [w + int(x) for x in wants]
    return [BUDGET] * NUM_LAYERS


# ---------------------------------------------------------------- the drive


def expected_schedule(trigger: str, budgets: list[int]) -> list[int]:
    """Logical lengths at which the trigger compresses: the prompt streamed a
    chunk past the smallest budget at a time, an over-budget prompt at its
    end, then (rolling) an interval past the budget at a time."""
    at, physical = [], [0] * len(budgets)

    def due(logical: int, slack: int) -> None:
        nonlocal physical
        if max(p - b for p, b in zip(physical, budgets)) >= slack:
            at.append(logical)
            physical = [min(p, b) for p, b in zip(physical, budgets)]

    for logical in range(1, PROMPT + DECODE):
        physical = [p + 1 for p in physical]
        if logical < PROMPT and trigger == "streamed":
            due(logical, CHUNK)
        elif logical == PROMPT:
            due(logical, 1)
        elif logical > PROMPT and trigger != "once":
            if trigger == "once_window" and logical == PROMPT + 1:  # past the prompt: its tokens plus the window
                budgets = [min(b, PROMPT) + DECODE_WINDOW for b in budgets]
            due(logical, INTERVAL)
    return at


@pytest.mark.parametrize("scorer, allocation, trigger, selection",
                         [c for c in COMBINATIONS if refusal(*c) is None])
def test_selection_equals_the_plain_reimplementation(scorer, allocation, trigger, selection):
    drive(scorer, allocation, trigger, selection)


PROTECTED = 40  # the request's protect_prefix: the protected start


@pytest.mark.parametrize("scorer, allocation, trigger, selection", [
    ("snapkv", "uniform", "once", "top"), ("snapkv", "pyramid", "once", "span"),
    ("h2o", "uniform", "rolling", "chunk"), ("tova", "adaptive", "rolling", "top"),
    ("streamingllm", "uniform", "streamed", "top"), ("rkv", "uniform", "rolling", "top"),
    ("keyformer", "uniform", "decode", "top"),
])
def test_protected_prefix_is_a_protected_start(scorer, allocation, trigger, selection):
    """A request's protect_prefix is kept whatever its score, budgets count the
    tokens after it, and its queries are not observed."""
    drive(scorer, allocation, trigger, selection, protect_prefix=PROTECTED)


def drive(scorer: str, allocation: str, trigger: str, selection: str, protect_prefix: int = 0) -> None:
    config = KVCompressConfig.from_dict({**config_for(scorer, allocation, trigger, selection),
                                         "protect_prefix": protect_prefix})
    plan = resolve_plan(config, PROMPT, NUM_LAYERS, BLOCK)
    state = RequestSchedule.create(plan, layer_groups(NUM_LAYERS, NUM_LAYERS))
    rc = RequestTokens(plan, NUM_LAYERS, HKV, HQ, geometry=GEOMETRY)
    observe = scorer in ATTENTION_SCORERS
    protected_len = PROMPT if trigger == "decode" else protect_prefix  # the prompt is kept whole
    assert plan.protected_len == protected_len
    observed_at: list[int] = []
    # The naive side's own view: per layer and KV head, the cached positions
    # (a set) and the attention accumulated per (query head, position).
    cached = [[set() for _ in range(HKV)] for _ in range(NUM_LAYERS)]
    attention = [dict() for _ in range(NUM_LAYERS)]
    queries: list[list] = [[] for _ in range(NUM_LAYERS)]  # per layer, each observed step's [HQ][KEY_DIM]
    compressed_at = []
    logical, step = 0, 0

    def feed(positions: list[int]) -> None:
        nonlocal step
        rc.append(torch.tensor(positions))
        for layer in range(NUM_LAYERS):
            for h in range(HKV):
                cached[layer][h].update(positions)
        mask = rc.observed(torch.tensor(positions))
        if not mask.any():
            return
        for q_pos in [p for p, m in zip(positions, mask.tolist()) if m]:
            step += 1
            observed_at.append(q_pos)
            for layer in range(NUM_LAYERS):
                if scorer in QUERY_SCORERS:  # the query itself, before RoPE
                    queries[layer].append([query_vector(step, layer, q) for q in range(HQ)])
                    rc.observe_queries(layer, torch.tensor(queries[layer][-1:], dtype=torch.float32))
                    continue
                order = rc.positions(layer)  # [Hkv, T]: the cache order the engine scores in
                rows = attention_rows(step + 1000 * layer, q_pos + 1)
                by_query_head = order.repeat_interleave(GROUP, dim=0)  # [HQ, T]
                row = torch.where(by_query_head <= q_pos, rows.gather(1, by_query_head.clamp(max=q_pos)), 0.0)
                if scorer == "tova":  # the newest query replaces the last
                    attention[layer] = {}
                values = rows.tolist()
                for q in range(HQ):
                    for p in cached[layer][q // GROUP]:
                        if p <= q_pos:
                            attention[layer][q, p] = attention[layer].get((q, p), 0.0) + values[q][p]
                rc.accumulate(layer, row.float())

    def compress_if_due() -> None:
        targets = state.next_compression(logical)
        if targets is None:
            return
        compressed_at.append(logical)
        per_head_counts = None
        for layer in range(NUM_LAYERS):
            order = rc.positions(layer)
            keys, values = (torch.tensor([[vector(layer, h, p) for p in row] for h, row in enumerate(order.tolist())])
                            for vector in (key_vector, value_vector))
            keep = rc.select(layer, targets[layer], keys, values)
            got = order.gather(1, keep)
            dead = rc._dead_after.get(layer)
            if allocation == "per_head":
                ranked_heads = [naive_ranked(scorer, selection, g, layer, sorted(cached[layer][g]),
                                             attention[layer], rc.num_compressions, BUDGET, queries=queries[layer],
                                             logical_len=logical) for g in range(HKV)]
                per_head_counts = plain_head_counts(ranked_heads, BUDGET, alpha=0.2)
            for h in range(HKV):
                positions = sorted(cached[layer][h])
                if per_head_counts is not None:
                    live = got[h] if dead is None else got[h][~dead[h]]
                    assert_top(set(live.tolist()), ranked_heads[h], positions, per_head_counts[h], (layer, h))
                else:
                    # Past the prompt, once_window keeps every prompt token left and the newest outputs.
                    protection = (PROMPT, DECODE_WINDOW) if trigger == "once_window" and logical > PROMPT else None
                    ranked = naive_ranked(scorer, selection, h, layer, positions, attention[layer],
                                          rc.num_compressions, targets[layer] - protected_len, protected_len,
                                          protection, queries[layer], logical)
                    assert_top(set(got[h].tolist()), ranked, positions, targets[layer], (layer, h, logical))
                cached[layer][h] = set(got[h].tolist())
            rc.keep_selected(layer, keep)
            for key in [k for k in attention[layer] if k[1] not in cached[layer][k[0] // GROUP]]:
                del attention[layer][key]
            if scorer == "rkv":  # the next observation window starts afresh
                attention[layer] = {}
            if scorer in QUERY_SCORERS and trigger == "once":  # never read again
                queries[layer] = []
        if per_head_counts is not None:
            assert max(per_head_counts) <= targets[-1]
        rc.finish_compaction()
        state.commit(logical, targets)

    while logical < PROMPT:  # the prompt, in the chunks the schedule allows
        compress_if_due()
        cap = state.tokens_until_due(logical)
        end = PROMPT if cap is None else min(PROMPT, logical + cap)
        rc.next_due = state.next_due(logical)  # what the scheduler sends the workers each step
        feed(list(range(logical, end)))
        logical = end
    if scorer in REPEAT_SCORERS:  # what the worker takes from the passes (where budgets follow them, at their end)
        rc.take_repeat_scores([repeat_scores(layer) for layer in range(NUM_LAYERS)])
    if state.budgets_pending:  # what the worker reports at prefill end (KVzip: its passes' end)
        reported = rc.attention_budgets()
        if allocation == "adaptive":
            # KVzip: each query head holds its KV head's repeat scores.
            seen = [{(q, p): repeat_scores(layer)[q // GROUP, p].item() for q in range(HQ) for p in range(PROMPT)}
                    for layer in range(NUM_LAYERS)] if scorer in REPEAT_SCORERS else attention
            assert list(reported) == naive_layer_keeps(allocation, scorer, seen, list(range(PROMPT)))
        state.set_layer_budgets(reported)
    elif observe or allocation in ("pyramid", "retrieval"):
        keeps = naive_layer_keeps(allocation, scorer, attention, list(range(PROMPT)),
                                  None if trigger == "decode" else PROMPT - protected_len)
        assert list(state.budgets) == [protected_len + k for k in keeps]
    budgets = list(state.budgets)
    while logical < PROMPT + DECODE:
        compress_if_due()
        rc.next_due = state.next_due(logical)
        feed([logical])
        logical += 1
    assert compressed_at == expected_schedule(trigger, budgets)
    assert compressed_at, "the request was compressed"
    assert all(p >= protected_len for p in observed_at), "queries of the protected start are not observed"
    if scorer == "rkv":  # R-KV's window: the last `window` queries before each compression
        window = SCORER_PARAMS["rkv"]["window"]
        for at in compressed_at:
            assert set(range(max(at - window, protected_len), at)) <= set(observed_at), at
        assert len(observed_at) <= window * (len(compressed_at) + 1)
