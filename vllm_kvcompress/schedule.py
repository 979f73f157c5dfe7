"""When a request is compressed and to how many tokens: pure bookkeeping.

The scheduler (which frees blocks), the worker (which compacts) and the
reference decoder (the test oracle) all follow this one state machine over
the request's `CompressionPlan`, so they agree on every compression without
talking to each other. The decision needs only lengths; which tokens survive
is the scorer's and the selection's business, in the worker.

Lengths: *logical* counts every token the request has seen (RoPE positions,
vLLM's `num_computed_tokens`); *physical* counts the cache slots it holds.
`num_evicted` = logical - physical.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .plan import CompressionPlan
from .triggers import Hold


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_groups(num_layers: int, num_groups: int) -> list[int]:
    """KV cache group of each layer: contiguous tiers of equal size."""
    if num_groups < 1 or num_layers % num_groups:
        raise ValueError(
            f"kv_compress.layer_groups: {num_groups} does not divide the model's {num_layers} layers; "
            f"valid values: {[g for g in range(1, num_layers + 1) if num_layers % g == 0]}"
        )
    size = num_layers // num_groups
    return [layer // size for layer in range(num_layers)]


@dataclass
class RequestSchedule:
    """One request's compression state. Reset when its KV cache is dropped.

    Lengths are per KV cache group (one group unless the engine splits the
    layers, see `layer_groups`): groups whose layers keep different budgets
    hold different physical lengths.
    """

    plan: CompressionPlan | None  # None: compression off
    group_of_layer: list[int] = field(default_factory=lambda: [0])
    budgets: tuple[int, ...] | None = None  # per group; None: compression off
    num_evicted: list[int] = field(default_factory=lambda: [0])  # per group
    num_compressions: int = 0
    compressed_at: int = 0  # the logical length at the last compression (0: none)
    prefill_checked: bool = False
    # The allocation derives layer budgets from the prompt's attention: the
    # worker reports them at prefill end (`set_layer_budgets`).
    budgets_pending: bool = False
    # No length below this one compresses, as things stand: set by
    # `next_compression` only past the prompt's compression (NEVER without a
    # plan), reset by any change of lengths or budgets (`_changed`). A
    # request's length never goes back past where it was set (a resumed
    # request starts a new schedule), so `logical_len < quiet_below` is the
    # whole test, here and in the scheduler's per-step pass over hundreds of
    # requests: one comparison each.
    quiet_below: int = field(default=0, compare=False)
    _room: int | None = field(default=None, compare=False, repr=False)  # `_room_after_prompt`, cached
    # Counts the changes of lengths and budgets (admission rebuilds a
    # request's forecast when it moves).
    version: int = field(default=0, compare=False)

    @classmethod
    def create(cls, plan: CompressionPlan | None, group_of_layer: list[int] | None = None) -> RequestSchedule:
        """`group_of_layer`: the engine's layer -> KV cache group map (default: one group)."""
        group_of_layer = group_of_layer or [0]
        state = cls(plan=plan, group_of_layer=group_of_layer, num_evicted=[0] * (max(group_of_layer) + 1))
        if plan is None:
            state.quiet_below = NEVER
        else:
            if len(plan.layer_budgets) != len(group_of_layer):
                raise ValueError(f"kv_compress: a plan for {len(plan.layer_budgets)} layers on "
                                 f"{len(group_of_layer)} layers")
            state.budgets_pending = plan.budgets_after_prompt and plan.compresses_prompt
            # While pending, the plan's stand-ins are never read: such
            # allocations need attention, so their prompts are not streamed.
            state.budgets = state._group_budgets(plan.layer_budgets)
        return state

    def _group_budgets(self, per_layer) -> tuple[int, ...]:
        # A group's layers share one block table, so they keep its largest
        # budget, after the protected start (which every layer keeps whole).
        protected = self.plan.protected_len if self.plan is not None else 0
        return tuple(protected + max(b for b, g in zip(per_layer, self.group_of_layer) if g == group)
                     for group in range(len(self.num_evicted)))

    def set_layer_budgets(self, per_layer) -> None:
        """The per-layer budgets the worker derived from the prompt's attention."""
        if len(per_layer) != len(self.group_of_layer):
            raise ValueError(f"kv_compress: {len(per_layer)} layer budgets for {len(self.group_of_layer)} layers")
        self.budgets = self._group_budgets(per_layer)
        self.budgets_pending = False
        self._changed()

    def start_from(self, num_evicted: tuple[int, ...]) -> None:
        """The request starts from a saved compressed state (`reuse`): its first
        tokens' KV is there already, this many fewer per group than tokens."""
        self.num_evicted = list(num_evicted)
        self._changed()

    def physical(self, logical_len: int) -> tuple[int, ...]:
        return tuple(logical_len - e for e in self.num_evicted)

    def next_compression(self, logical_len: int) -> tuple[int, ...] | None:
        """Physical length per group to compress to before the next token is written.

        `logical_len` is the number of tokens whose KV is in the cache. Called
        once per scheduling step; returns None when nothing is to be evicted.
        """
        if self.plan is None or self.budgets is None:
            return None
        if logical_len < self.quiet_below:
            return None
        physical = self.physical(logical_len)
        over = [p - b for p, b in zip(physical, self.budgets)]
        targets = tuple(min(p, b) for p, b in zip(physical, self.budgets))
        if logical_len < self.plan.prompt_len:  # still prefilling: the trigger says (streamed)
            return targets if self.plan.trigger.due_in_prompt(max(over)) else None
        if not self.prefill_checked:
            # Prefill just ended: every trigger compresses an over-budget prompt.
            if self.budgets_pending:
                raise RuntimeError(f"kv_compress: the {self.plan.allocation.name} layer budgets of this request "
                                   f"were not reported at the end of its prefill")
            self.prefill_checked = True
            return targets if max(over) > 0 else None
        if not self.plan.trigger.repeats():  # compressed at its prompt's end, if at all: never again
            self.quiet_below = NEVER
            return None
        budgets = self._budgets_after_prompt()
        over = [p - b for p, b in zip(physical, budgets)]
        targets = tuple(min(p, b) for p, b in zip(physical, budgets))
        if self.plan.trigger.due_after_prompt(max(over), self.plan.interval):
            return targets
        # Not due until the first group is an interval past its budget
        # (tests/test_core.py checks the two rules agree).
        self.quiet_below = self._room_after_prompt()
        return None

    def _room_after_prompt(self) -> int:
        """The logical length at which a repeating trigger next compresses
        past the prompt: where the first KV cache group is an interval past
        the budget it compresses back to."""
        if self._room is None:
            assert self.plan is not None
            self._room = min(b + e + self.plan.interval for b, e in zip(self._budgets_after_prompt(), self.num_evicted))
        return self._room

    def _budgets_after_prompt(self) -> tuple[int, ...]:
        """Per group, what a request past its prompt compresses back to (the trigger's rule)."""
        assert self.plan is not None and self.budgets is not None
        return tuple(self.plan.trigger.budget_after_prompt(b, self.plan.prompt_len) for b in self.budgets)

    def tokens_until_due(self, logical_len: int) -> int | None:
        """Most tokens the next step may compute before a compression is due (None: no limit).

        A chunk of tokens computed together must end where the next
        compression is due, so that every run compresses at the same tokens
        whatever its batching and chunking: a streamed prompt, and a preempted
        request that recomputes its prompt and outputs as one prefill (it
        then replays its compressions at the points of its first life).
        Called after this step's compressions were planned, so nothing is due now.
        """
        if self.plan is None or self.budgets is None:
            return None
        physical = self.physical(logical_len)
        if logical_len < self.plan.prompt_len:  # the prompt's end is always a compression point
            cap = self.plan.prompt_len - logical_len
            chunk = self._prompt_chunk()
            if chunk:
                cap = min(cap, min(b + chunk - p for p, b in zip(physical, self.budgets)))
            return max(cap, 0)
        return self.plan.trigger.tokens_until_due(min(b + self.plan.interval - p
                                                      for p, b in zip(physical, self._budgets_after_prompt())))

    def next_due(self, logical_len: int) -> int | None:
        """The logical length at which this request next compresses, as things
        stand (None: never): what the workers observe up to (R-KV's window of
        queries before each compression). Called after this step's
        compressions were planned."""
        if self.plan is None or self.budgets is None:
            return None
        trigger, prompt_len = self.plan.trigger, self.plan.prompt_len
        if logical_len < self.quiet_below:
            return None if self.quiet_below == NEVER else self.quiet_below  # as below, cached
        if logical_len < prompt_len:
            chunk = trigger.chunk_size()
            if chunk:  # streamed: the next chunk end, or the prompt's end
                return min(prompt_len, min(b + e + chunk for b, e in zip(self.budgets, self.num_evicted)))
            if self.budgets_pending or max(prompt_len - e - b for b, e in zip(self.budgets, self.num_evicted)) > 0:
                return prompt_len  # an over-budget prompt compresses at its end
        if not trigger.repeats():
            return None
        # Past the prompt's compression: when the first group is an interval past its budget.
        return max(self._room_after_prompt(), logical_len)

    def longest_prefix_hit(self) -> int | None:
        """Most leading tokens the request may take from vLLM's prefix cache
        (None: any number), so that the hit never changes what it keeps.

        A hit's tokens are never computed by the request: their keys and
        values come from the cache, and their queries are never observed. So
        a hit ends where the request first compresses (a cached block holds
        keys computed from an uncompressed context), and at the first query
        its scorer observes, unless that query is in the protected start
        (which attends only protected keys: nothing to learn from it).
        Called on a request not yet computing (its state as created).
        """
        if self.plan is None or self.budgets is None:
            return None
        first_due = self.next_due(0)
        if first_due is None:  # never compresses: any hit serves
            return None
        scorer = self.plan.scorer
        observed = scorer.observe.first_query(self.plan.prompt_len, scorer.window_queries(), first_due)
        return min(first_due, max(self.plan.protected_len, observed))

    def max_physical(self, total_len: int) -> int | None:
        """Most tokens the request holds while computing its first `total_len`
        tokens, for admission (None: all of them, as vLLM assumes).

        Bounded for a streamed prompt, and for a preempted request that
        recomputes prompt and outputs (compressing on the way, as in its
        first life); otherwise admission needs the whole prompt, as without
        compression.
        """
        if self.plan is None or self.budgets is None:
            return None
        chunk = self._prompt_chunk()
        prompt_len = self.plan.prompt_len
        if not chunk and total_len <= prompt_len:
            return None
        most = max(self.budgets)
        # The prompt: whole, or a chunk past the budget at a time.
        hold = most + max(chunk, self.plan.interval) if chunk else prompt_len
        # After it: as the trigger says (the budget plus an interval, or every output).
        after = self.plan.trigger.held_after_prompt(most, prompt_len, total_len, self.plan.interval)
        return min(total_len, max(hold, after))

    def peak_physical(self, logical_len: int, final_len: int) -> tuple[int, ...] | None:
        """Most tokens each KV cache group holds from `logical_len` tokens
        computed until `final_len` (None: compression off, all of them), for
        growth-aware admission (the scheduler's `_admits`).

        The prompt, if still ahead, whole (or its budget plus a streamed
        chunk); after it, what the trigger keeps (`held_after_prompt`: the
        budget plus every output under 'once', plus an interval under a
        rolling trigger). Layer budgets still to come from the prompt's
        attention count as the whole prompt.
        """
        if self.plan is None or self.budgets is None:
            return None
        plan, chunk = self.plan, self._prompt_chunk()
        prompt_len = plan.prompt_len
        out = []
        for budget, evicted in zip(self.budgets, self.num_evicted):
            if self.budgets_pending:
                budget = max(budget, prompt_len)
            held = [logical_len - evicted]
            if logical_len < prompt_len:
                held.append(budget + max(chunk, plan.interval) if chunk else prompt_len)
            if final_len > prompt_len:
                held.append(plan.trigger.held_after_prompt(budget, prompt_len, final_len, plan.interval))
            out.append(max(0, min(max(held), final_len - evicted)))
        return tuple(out)

    def held_after_prompt(self, total_len: int) -> tuple[int, ...] | None:
        """Most tokens each KV cache group holds once past its prompt's
        compression, computing up to `total_len` tokens (None: compression
        off, all of them): the budget plus every output under 'once', plus an
        interval under a rolling trigger. Admission reads the same as lines
        (`holds_after_prompt`); this is their value at one length."""
        holds = self.holds_after_prompt()
        return None if holds is None else tuple(max(0, hold.at(total_len)) for hold in holds)

    def holds_after_prompt(self) -> tuple[Hold, ...] | None:
        """`held_after_prompt` per group as a line in the total length (less
        than 0 reads as 0): the trigger's hold, never more than the tokens the
        request has left after its evictions so far."""
        if self.plan is None or self.budgets is None:
            return None
        plan = self.plan
        out = []
        for budget, evicted in zip(self.budgets, self.num_evicted):
            if self.budgets_pending:
                budget = max(budget, plan.prompt_len)
            hold = plan.trigger.hold_after_prompt(budget, plan.prompt_len, plan.interval)
            out.append(Hold(offset=-evicted if hold.offset is None else min(hold.offset, -evicted), cap=hold.cap))
        return tuple(out)

    def _prompt_chunk(self) -> int:
        return 0 if self.plan is None else self.plan.trigger.chunk_size()

    def commit(self, logical_len: int, targets: tuple[int, ...]) -> None:
        """Record a compression to these physical lengths."""
        self.num_evicted = [logical_len - t for t in targets]
        self.num_compressions += 1
        self.compressed_at = logical_len
        self._changed()

    def _changed(self) -> None:
        """Lengths or budgets changed: what was derived from them goes."""
        self.quiet_below, self._room = 0, None
        self.version += 1


NEVER = sys.maxsize  # `quiet_below` of a request that never compresses again
