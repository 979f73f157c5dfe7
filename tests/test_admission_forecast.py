"""Growth-aware admission kept from step to step admits exactly what the rule
rebuilt at every check admitted.

`GrowthForecast` (admission.py) keeps the running requests' blocks over the
steps ahead in absolute steps and rebuilds a request's share only when what
it depends on changes. The rule it replaces (`todays_rule`, below, as the
scheduler had it through 2026-12) followed every running request and the
new one forward at every check. Random workloads of every trigger, layer
groups, reported budgets, chunked prefills, skipped steps, preemptions and
requests started within a step: at each check, the free blocks at which the
rule starts to admit, one less, and random others; both must agree.
"""

from __future__ import annotations

import random

import pytest

from vllm_kvcompress.admission import GrowthForecast, Outlook, Timeline
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.schedule import RequestSchedule, cdiv

BLOCK = 16
LAYERS = 4
CONFIGS = [
    {"policy": "none"},
    {"policy": "snapkv", "budget": 64},
    {"policy": "snapkv-span", "compression_ratio": 0.75},
    {"policy": "streamingllm", "budget": 40, "trigger": "rolling", "interval": 16},
    {"policy": "streamingllm", "budget": 48, "trigger": "streamed", "prompt_chunk": 32},
    {"policy": "snapkv-span-window", "budget": 32, "decode_window": 24, "interval": 8},
    {"policy": "h2o", "budget": 24, "trigger": "decode", "interval": 8},
    {"policy": "pyramidkv", "budget": 48},
    {"policy": "adaptive", "budget": 48},
]


# ------------------------------------------------------------ today's rule

def _timeline(o: Outlook, running: bool, groups: int, max_sched: int) -> tuple:
    """KVCompressScheduler._timeline as it was (a request's inputs from an Outlook)."""
    state, size = o.schedule, BLOCK
    plan = state.plan is not None

    def blocks(tokens) -> int:
        return sum(cdiv(t, size) for t in tokens)

    def blocks_of(length: int) -> int:
        held = state.held_after_prompt(length) if plan else None
        return blocks(held) if held is not None else groups * cdiv(length, size)

    logical, start, final = o.computed, o.total, o.final
    prefill = cdiv(start - logical, max_sched) if start - logical > 1 else 0
    peak = state.peak_physical(logical, min(final, start)) if plan else None
    prefilling = blocks(peak) if peak is not None else groups * cdiv(min(final, start), size)
    return (o.held if running else prefilling), prefill, start, final, blocks_of, prefilling


def _blocks_at(line: tuple, step: int) -> int:
    held, prefill, start, final, blocks_of, prefilling = line
    if step == 0:
        return max(held, blocks_of(start) if not prefill else held)
    if step < prefill:
        return max(held, prefilling)
    length = start + step - max(prefill - 1, 0)
    return 0 if length > final else blocks_of(length)


def todays_rule(running: list[Outlook], new: Outlook, free: int, groups: int, max_sched: int) -> bool:
    lines = [_timeline(o, True, groups, max_sched) for o in running] + [_timeline(new, False, groups, max_sched)]
    capacity = free + sum(line[0] for line in lines[:-1])
    steps = {0} | {t for line in lines for t in (line[1] - 1, line[3] - line[2] + max(line[1] - 1, 0))}
    return all(sum(_blocks_at(line, t) for line in lines) <= capacity for t in steps if t >= 0)


def least_free(running: list[Outlook], new: Outlook, groups: int, max_sched: int) -> int:
    """The fewest free blocks at which today's rule admits `new`."""
    lines = [_timeline(o, True, groups, max_sched) for o in running] + [_timeline(new, False, groups, max_sched)]
    steps = {0} | {t for line in lines for t in (line[1] - 1, line[3] - line[2] + max(line[1] - 1, 0))}
    held = sum(line[0] for line in lines[:-1])
    return max(sum(_blocks_at(line, t) for line in lines) for t in steps if t >= 0) - held


# ------------------------------------------------------------ workloads

class Sim:
    """Requests computing a token a step (or a prefill chunk), compressing as their schedule says."""

    def __init__(self, rng: random.Random, groups: int, max_sched: int) -> None:
        self.rng, self.groups, self.max_sched = rng, groups, max_sched
        self.group_of_layer = [layer * groups // LAYERS for layer in range(LAYERS)]
        self.running: dict[str, dict] = {}
        self.next_id = 0

    def new(self) -> dict:
        rng = self.rng
        prompt = rng.randint(20, 300)
        config = dict(rng.choice(CONFIGS if self.groups > 1 else CONFIGS[:-2]))  # per-layer budgets need groups
        if self.groups > 1:
            config["layer_groups"] = self.groups
        plan = resolve_plan(KVCompressConfig.from_dict(config), prompt, LAYERS, BLOCK)
        final = prompt + rng.randint(1, 200)
        cached = rng.choice([0, 0, BLOCK * rng.randint(0, prompt // BLOCK)])
        self.next_id += 1
        return {"id": f"r{self.next_id}", "state": RequestSchedule.create(plan, self.group_of_layer),
                "computed": min(cached, prompt - 1), "total": prompt, "final": min(final, 512), "extra": 0}

    def outlook(self, r: dict, held: int | None = None) -> Outlook:
        state = r["state"]
        if held is None:
            held = sum(cdiv(p, BLOCK) for p in state.physical(r["computed"])) + r["extra"]
        return Outlook(held=held, computed=r["computed"], total=r["total"], final=r["final"], schedule=state)

    def step(self) -> None:
        rng = self.rng
        for rid, r in list(self.running.items()):
            if rng.random() < 0.02:  # preempted: its cache is gone
                del self.running[rid]
                continue
            state = r["state"]
            targets = state.next_compression(r["computed"])
            if targets is not None:
                state.commit(r["computed"], targets)
            if rng.random() < 0.1:  # not scheduled this step
                continue
            pending = r["total"] - r["computed"]
            until = state.tokens_until_due(r["computed"])
            chunk = min(pending, self.max_sched, until if until is not None else pending)
            r["computed"] += max(chunk, 1)
            if r["computed"] >= r["total"]:
                r["computed"] = r["total"]
                r["total"] += 1  # a token sampled
                if state.budgets_pending and r["computed"] >= state.plan.prompt_len:
                    state.set_layer_budgets([rng.randint(8, 64) for _ in range(LAYERS)])
            r["extra"] = rng.choice([0, 0, 0, 1])  # blocks allocated ahead
            if r["total"] > r["final"]:
                del self.running[rid]


@pytest.mark.parametrize("seed", range(3))
def test_the_kept_forecast_admits_what_the_rebuilt_rule_admits(seed):
    rng = random.Random(seed)
    groups = (1, 2, 4)[seed % 3]
    max_sched = rng.choice([64, 256, 2048])
    sim = Sim(rng, groups, max_sched)
    forecast = GrowthForecast(BLOCK, groups, max_sched)
    checks = admitted = 0
    for step in range(1, 250):
        sim.step()
        forecast.sync(step, ((rid, sim.outlook(r)) for rid, r in sim.running.items()))
        for _ in range(rng.randint(0, 3)):
            if not sim.running:
                break
            request = sim.new()
            new = sim.outlook(request, held=0)
            running = [sim.outlook(r) for r in sim.running.values()]
            need = least_free(running, new, groups, sim.max_sched)
            # Today's rule admits at `free` blocks iff free >= need (its
            # capacity grows with free, nothing else does): checked at the
            # threshold, here, and the kept forecast at it and elsewhere.
            assert todays_rule(running, new, need, groups, sim.max_sched)
            # (and far above it, where admission takes its shortcut)
            for free in (need - 1, need, need + rng.randint(1, 20), rng.randint(0, 200), need + rng.randint(0, 5000)):
                assert forecast.admits(new, free) == (free >= need), (seed, step, free, need)
                checks += 1
            if rng.random() < 0.6:  # started in this step: the next check sees it running
                sim.running[request["id"]] = request
                forecast.update(request["id"], sim.outlook(request))
                admitted += 1
        if len(sim.running) < 3:
            for _ in range(3):
                request = sim.new()
                sim.running[request["id"]] = request
    assert checks > 500 and admitted > 100
    # Most steps reuse each running request's share: the work follows what changed.
    assert forecast.rebuilds < forecast.updates / 2


def test_a_timeline_in_one_array_is_its_steps_one_by_one():
    """`Timeline.ahead` (the vector form) equals today's step-by-step blocks."""
    rng = random.Random(7)
    sim = Sim(rng, 2, 64)
    for _ in range(200):
        r = sim.new()
        for _ in range(rng.randint(0, 40)):
            sim.running = {r["id"]: r}
            sim.step()
        o = sim.outlook(r)
        for running in (True, False):
            line = _timeline(o, running, 2, 64)
            timeline = Timeline.of(o, running, BLOCK, 2, 64)
            assert timeline.now == _blocks_at(line, 0)
            assert list(timeline.ahead()) == [_blocks_at(line, t) for t in range(1, timeline.last_step + 1)]
            assert _blocks_at(line, max(timeline.last_step + 1, 1)) == 0
