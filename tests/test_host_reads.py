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

from vllm_kvcompress.budgets import ALLOCATIONS
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.scorers import SCORERS
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
    return RequestTokens(plan, LAYERS, HKV, HQ, device="meta")


COMPOSITIONS = [c for c in itertools.product(sorted(set(SCORERS) - {"keep_all"}), sorted(ALLOCATIONS),
                                             sorted(SELECTIONS)) if meta_state(*c) is not None]


@pytest.mark.parametrize("scorer, allocation, selection", COMPOSITIONS)
def test_selection_runs_on_the_device_without_host_reads(scorer, allocation, selection):
    state = meta_state(scorer, allocation, selection)
    assert state is not None
    state.append(torch.arange(PROMPT))  # step positions are host data
    if state.scorer.observe.attends():
        for layer in range(LAYERS):
            state.accumulate(layer, torch.rand(HQ, PROMPT, device="meta"))
    slots = list(state.plan.layer_budgets)
    if state.plan.budgets_after_prompt:
        layer_slots = state.layer_slots()
        assert layer_slots.device.type == "meta" and layer_slots.shape == (LAYERS,)
        slots = [state.plan.budget] * LAYERS  # the scheduler's numbers: here any plausible ones
    keys = torch.empty(HKV, PROMPT, DIM, device="meta")
    for layer in range(LAYERS):
        keep = state.select(layer, state.plan.protected_len + slots[layer], lambda: keys)
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
