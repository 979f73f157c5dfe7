"""Compaction decides on the cache's device: nothing of it is read on the host.

Three checks: every composition's scoring, selection and bookkeeping runs on
PyTorch's "meta" device (shapes without data: any host read, `.item()` or
`int(tensor)` included, raises, and so does a tensor made on another
device); no module of the package reads tensors on the host except through
`host_reads.read`, which names why; and (test_engine_*) a real engine counts
those reads per step.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

from helpers import plain_best, plain_head_counts
from vllm_kvcompress.budgets import ALLOCATIONS
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.scorers import SCORERS
from vllm_kvcompress.scorers.expected_attention import QueryGeometry
from vllm_kvcompress.selection import SELECTIONS
from vllm_kvcompress.token_state import RequestTokens

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_kvcompress"
LAYERS, HKV, HQ, DIM, PROMPT = 4, 2, 4, 8, 96


def meta_state(scorer: str, allocation: str, selection: str) -> RequestTokens | None:
    data = {"policy": scorer, "allocation": allocation, "selection": selection, "budget": 40,
            "layer_groups": LAYERS, "merge": "minicache" if allocation == "uniform" and scorer == "snapkv" else "none"}
    if allocation == "retrieval":
        return None  # the allocation's budgets are the profile's: known before the prompt, as pyramid's
    try:
        config = KVCompressConfig.from_dict(data)
    except KVCompressConfigError:
        return None  # a refused composition
    plan = resolve_plan(config, PROMPT, LAYERS, 16)
    assert plan is not None
    return RequestTokens(plan, LAYERS, HKV, HQ, device="meta", geometry=META_ROPE)


# Expected attention's RoPE tables, on the device like everything else.
META_ROPE = QueryGeometry(cos_sin=lambda p: (torch.rand(len(p), DIM // 2, device="meta"),) * 2, max_position=4096,
                          scale=DIM ** -0.5)


COMPOSITIONS = [c for c in itertools.product(sorted(set(SCORERS) - {"keep_all"}), sorted(ALLOCATIONS),
                                             sorted(SELECTIONS)) if meta_state(*c) is not None]


@pytest.mark.parametrize("scorer, allocation, selection", COMPOSITIONS)
def test_selection_runs_on_the_device_without_host_reads(scorer, allocation, selection):
    state = meta_state(scorer, allocation, selection)
    assert state is not None
    state.append(torch.arange(PROMPT))  # step positions are host data
    for layer in range(LAYERS):
        if state.scorer.observe.scores_attention():
            state.accumulate(layer, torch.rand(HQ, PROMPT, device="meta"))
        elif state.scorer.observe.attends():  # expected attention: the queries themselves
            state.observe_queries(layer, torch.rand(PROMPT, HQ, DIM, device="meta"))
    if state.scorer.reconstructs_context:  # KVzip: its repeat passes' scores, by logical position
        state.take_repeat_scores([torch.rand(HKV, PROMPT, device="meta") for _ in range(LAYERS)])
    slots = list(state.plan.layer_budgets)
    if state.plan.budgets_after_prompt:
        layer_slots = state.layer_slots()
        assert layer_slots.device.type == "meta" and layer_slots.shape == (LAYERS,)
        slots = [state.plan.budget] * LAYERS  # the scheduler's numbers: here any plausible ones
    keys = torch.empty(HKV, PROMPT, DIM, device="meta")
    for layer in range(LAYERS):
        keep = state.select(layer, state.plan.protected_len + slots[layer], lambda: keys, lambda: keys)
        assert keep.device.type == "meta" and keep.shape[0] == HKV
        state.keep_selected(layer, keep)
    state.finish_compaction()
    assert all(state.positions(layer).device.type == "meta" for layer in range(LAYERS))


# ---------------------------------------------------------------- no other host reads in the package

READS = {"item", "tolist", "cpu", "numpy"}
def host_reads_in(path: Path) -> list[str]:
    """`x.item()`, `x.tolist()`, `x.cpu()`, `x.numpy()` and `x.to("cpu")` calls outside the helper."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        to_host = name == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in node.args)
        if name in READS or to_host:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{name}()")
    return found


def test_device_data_is_read_on_the_host_only_through_the_helper():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "host_reads.py"
             for hit in host_reads_in(path)]
    assert found == [], "read device tensors through host_reads.read(tensor, why):\n" + "\n".join(found)


# ---------------------------------------------------------------- the device selection equals a plain loop

def plain_ranked(scores: list[float], positions: list[int], sinks: int, recent: int, selection) -> list[float]:
    """methods.md's ranking of one head's tokens, one token at a time: the
    selection modifier's scores, protected tokens (position < sinks, or among
    the `recent` newest) at +inf."""
    inf = float("inf")
    newest = set(sorted(positions, reverse=True)[:recent]) if recent else set()
    protected = [p < sinks or p in newest for p in positions]
    chrono = sorted(range(len(positions)), key=lambda i: positions[i])
    if selection.name == "span":
        sunk = [positions[i] < selection.sink_tokens for i in range(len(positions))]
        source = [-inf if protected[i] or sunk[i] else scores[i] for i in range(len(scores))]
        carried = list(scores)
        for n, i in enumerate(chrono):
            carried[i] = max(source[j] for j in chrono[max(0, n - selection.span + 1): n + 1])
        scores = [inf if sunk[i] else carried[i] for i in range(len(scores))]
    if selection.name == "chunk":
        free = [i for i in chrono if not protected[i]]
        chunks = [free[c: c + selection.chunk_length] for c in range(0, len(free), selection.chunk_length)]
        order = [i for c in sorted(range(len(chunks)), key=lambda c: -sum(scores[i] for i in chunks[c]))
                 for i in chunks[c]]
        scores = [-inf] * len(scores)
        for rank, i in enumerate(order):
            scores[i] = float(len(order) - rank)
    return [inf if protected[i] else s for i, s in enumerate(scores)]


SELECTED = [("uniform", "top"), ("uniform", "span"), ("uniform", "chunk"), ("per_head", "top"), ("per_head", "span")]


def selection_setup(allocation: str, selection: str):
    """The allocation and selection modifier under test, with the parameters these tests use."""
    params = {"span": {"span": 3, "sink_tokens": 2}, "chunk": {"chunk_length": 4}}.get(selection, {})
    return ALLOCATIONS[allocation](**({"alpha": 0.3} if allocation == "per_head" else {})), \
        SELECTIONS[selection](**params)


def random_layer(gen, allocation: str, select_with, heads: int = 3):
    """A random layer to select (few score values: many ties) and methods.md's
    answer for it: (LayerToSelect, ranked per head, counts per head, slots)."""
    from vllm_kvcompress.budgets import LayerToSelect
    from vllm_kvcompress.sharding import ONE_DEVICE

    tokens = int(torch.randint(6, 40, (1,), generator=gen))
    scores = torch.randint(0, 4, (heads, tokens), generator=gen).float()
    positions = torch.stack([torch.randperm(tokens, generator=gen) for _ in range(heads)])
    sinks, recent = int(torch.randint(0, 3, (1,), generator=gen)), int(torch.randint(0, 3, (1,), generator=gen))
    budget = int(torch.randint(sinks + recent + 1, tokens + 1, (1,), generator=gen))
    ranked = [plain_ranked(scores[h].tolist(), positions[h].tolist(), sinks, recent, select_with)
              for h in range(heads)]
    if allocation == "per_head":
        counts = plain_head_counts(ranked, budget, 0.3)
        slots = max(counts)
    else:
        counts, slots = [budget] * heads, budget
    layer = LayerToSelect(scores, positions, slots=slots, layer_budget=budget, budget=budget,
                          protected=lambda b, fixed=(sinks, recent): fixed, selection=select_with, shard=ONE_DEVICE)
    return layer, ranked, counts, slots


def assert_plain_selection(got, ranked, counts, slots, where) -> None:
    """Each head keeps methods.md's tokens, in hole-filling order (a kept
    token below the new length stays in its slot)."""
    assert got.keep_idx.shape == (len(ranked), slots), where
    for h in range(len(ranked)):
        live = got.keep_idx[h] if got.dead is None else got.keep_idx[h][~got.dead[h]]
        assert sorted(live.tolist()) == sorted(plain_best(ranked[h], counts[h])), (where, h)
        assert all(int(i) == j for j, i in enumerate(got.keep_idx[h].tolist()) if i < slots), (where, h)


@pytest.mark.parametrize("allocation, selection", SELECTED)
def test_device_selection_equals_a_plain_loop_ties_included(allocation, selection):
    alloc, select_with = selection_setup(allocation, selection)
    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        layer, ranked, counts, slots = random_layer(gen, allocation, select_with)
        got = alloc.select(layer.scores, layer.positions, slots=layer.slots, layer_budget=layer.layer_budget,
                           budget=layer.budget, protected=layer.protected, selection=select_with,
                           shard=layer.shard)
        assert_plain_selection(got, ranked, counts, slots, trial)


@pytest.mark.parametrize("allocation, selection", SELECTED)
def test_batched_selection_equals_a_plain_loop_per_request(allocation, selection):
    """One `select_batch` over requests of different lengths, slots, budgets
    and protected tokens (the worker's per-layer batch) gives each request
    methods.md's selection (ties included), as a plain loop over the requests."""
    alloc, select_with = selection_setup(allocation, selection)
    gen = torch.Generator().manual_seed(11)
    for trial in range(25):
        cases = [random_layer(gen, allocation, select_with) for _ in range(int(torch.randint(1, 6, (1,),
                                                                                             generator=gen)))]
        got = alloc.select_batch([layer for layer, *_ in cases])
        for r, (selected, (_, ranked, counts, slots)) in enumerate(zip(got, cases)):
            assert_plain_selection(selected, ranked, counts, slots, (trial, r))


def test_selection_batches_bound_the_padded_tokens():
    from vllm_kvcompress.token_state import SELECTION_BATCH_TOKENS, selection_batches

    rows = [("a", 1000)] * 100 + [("b", 10)] * 3 + [("a", 2 * SELECTION_BATCH_TOKENS)] + [("a", 5)]
    batches = selection_batches(rows)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    for batch in batches:
        assert len({rows[i][0] for i in batch}) == 1  # one key per batch
        widest = max(rows[i][1] for i in batch)
        assert len(batch) == 1 or len(batch) * widest <= SELECTION_BATCH_TOKENS
    assert [103] in batches  # longer than a batch: alone
