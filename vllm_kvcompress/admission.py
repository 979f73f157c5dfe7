"""Growth-aware admission: whether a waiting compressed request may start now.

vLLM admits a request when its prompt's blocks are free. A compressed prompt
needs few blocks once compressed, so many are admitted, grow together (their
outputs are kept) and preempt each other; a preempted one recomputes its
whole prompt. Admission follows the running requests and the new one
forward, a token a step (`Timeline`): each holds what its plan keeps
(`RequestSchedule.held_after_prompt`, the new one its prompt first) until it
ends at its `max_tokens` or `max_model_len` (or `reserve_growth` tokens on)
and gives its blocks back. It starts only if at every step ahead they all
fit the blocks the running requests hold plus the free ones, less vLLM's
watermark.

The running requests' side is kept from step to step (`GrowthForecast`), not
rebuilt per check: rebuilt, it cost every waiting request's check the
running requests times their steps ahead (quadratic: one-second steps at
512 running). Each running request's blocks over the steps ahead are added
into one array indexed by absolute step. A request that computes a token a
step has the same future in absolute steps at every step, so its share is
rebuilt only when what it depends on changes (a compression, reported
budgets, a chunk of prefill, a step it was not scheduled in); a check costs
the new request's own steps ahead, and nothing of them where the most it
could ever hold (every token in every group) fits beside the running
requests' peak (most checks while memory is not short).

Plain code: the scheduler (vllm_seam/scheduler.py) hands it each request's
lengths and blocks (`Outlook`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .schedule import RequestSchedule, cdiv
from .triggers import Hold


class Outlook(NamedTuple):
    """What admission reads of one request (a tuple: the scheduler makes one
    per running request at each step where a request waits)."""

    held: int  # blocks it holds now, in the compressed KV cache groups
    computed: int  # tokens whose KV is in the cache (vLLM's num_computed_tokens)
    total: int  # its tokens: prompt and outputs (vLLM's num_tokens)
    final: int  # the length it ends at (max_tokens, max_model_len, reserve_growth)
    schedule: RequestSchedule  # plan None: uncompressed


@dataclass(frozen=True)
class Timeline:
    """One request's blocks over the steps ahead, every running request
    computing a token a step (a prefill: the scheduler's token budget a
    step). Step 0 is now: it holds what it holds (`now`). A request still
    prefilling holds its blocks or its prompt's peak, whichever is more; once
    prefilled, what its plan keeps at each length (`blocks_of`), until its
    final length (`last_step`); then none."""

    held: int
    prefill: int  # steps of prefill ahead (0: decoding)
    start: int  # its tokens now
    final: int
    prefilling: int  # blocks while it prefills
    holds: tuple[Hold, ...] | None  # per group, past the prompt (None: uncompressed)
    block_size: int
    num_groups: int

    @classmethod
    def of(cls, outlook: Outlook, running: bool, block_size: int, num_groups: int,
           max_num_scheduled_tokens: int) -> Timeline:
        """`running`: it holds its blocks; a waiting one holds its prefill's peak from step 0 on."""
        state, logical, start, final = outlook.schedule, outlook.computed, outlook.total, outlook.final
        prefill = cdiv(start - logical, max_num_scheduled_tokens) if start - logical > 1 else 0
        peak = state.peak_physical(logical, min(final, start))
        prefilling = (sum(cdiv(t, block_size) for t in peak) if peak is not None
                      else num_groups * cdiv(min(final, start), block_size))
        return cls(held=outlook.held if running else prefilling, prefill=prefill, start=start, final=final,
                   prefilling=prefilling, holds=state.holds_after_prompt(), block_size=block_size,
                   num_groups=num_groups)

    def blocks_of(self, length: int) -> int:
        """Blocks it holds past its prompt at this total length."""
        if self.holds is None:
            return self.num_groups * cdiv(length, self.block_size)
        return sum(cdiv(max(0, hold.at(length)), self.block_size) for hold in self.holds)

    def blocks_of_each(self, lengths: np.ndarray) -> np.ndarray:
        """`blocks_of` of every length in an integer array."""
        size = self.block_size
        if self.holds is None:
            return self.num_groups * -(-lengths // size)
        blocks = np.zeros_like(lengths)
        for hold in self.holds:
            blocks += -(-np.maximum(hold.at_each(lengths), 0) // size)
        return blocks

    def now_at(self, held: int, start: int) -> int:
        """Blocks at step 0, holding `held` with `start` tokens."""
        return held if self.prefill else max(held, self.blocks_of(start))

    @property
    def now(self) -> int:
        return self.now_at(self.held, self.start)

    @property
    def last_step(self) -> int:
        """The last step it holds blocks at (from the next it has ended)."""
        return max(self.prefill - 1, self.final - self.start + max(self.prefill - 1, 0))

    def ahead(self) -> np.ndarray:
        """Blocks at steps 1 .. `last_step`. A decoding request computes its
        pending token now; one still to prefill decodes its first output in
        the step after its prefill. Between the steps where it drops (the end
        of its prefill, its end) it never holds less from one step to the
        next, so the most the running requests and a new one hold together
        is at one of those steps, or now."""
        steps: np.ndarray = np.arange(1, self.last_step + 1, dtype=np.int64)
        decoding = self.blocks_of_each(self.start + steps - max(self.prefill - 1, 0))
        return np.where(steps < self.prefill, max(self.held, self.prefilling), decoding)


@dataclass
class _Share:
    """A running request's part of the forecast, and what it was built from."""

    key: tuple
    schedule: RequestSchedule
    timeline: Timeline
    built: int  # the step it was built at: its step t is absolute step built + t
    held: int
    now: int
    ahead: np.ndarray  # timeline.ahead(), as added into the demand


class GrowthForecast:
    """The running requests' blocks over the steps ahead, kept as they advance.

    `sync` at each step (or `update` for requests that started since),
    `retire` when one ends or is preempted, `admits` per waiting request.
    """

    def __init__(self, block_size: int, num_groups: int, max_num_scheduled_tokens: int) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.max_num_scheduled_tokens = max_num_scheduled_tokens
        self.step = 0
        self._shares: dict[str, _Share] = {}
        # Blocks the running requests hold at absolute step base + i (i >= 1
        # past each one's build step; its step 0 is `_now`).
        self._demand: np.ndarray = np.zeros(1024, dtype=np.int64)
        self._base = 0
        self._end = 0  # past the last absolute step any share holds blocks at
        self._now = 0  # blocks at this step (each share's `now`)
        self._held = 0  # blocks the running requests hold
        self.updates = self.rebuilds = 0  # shares brought up to date, and rebuilt for it
        self._changes = 0  # edits of `_demand`, for `_peak_ahead`'s cache
        self._peak: tuple[tuple[int, int], int] | None = None

    def timeline(self, outlook: Outlook, running: bool) -> Timeline:
        return Timeline.of(outlook, running, self.block_size, self.num_groups, self.max_num_scheduled_tokens)

    def sync(self, step: int, running: Iterable[tuple[str, Outlook]]) -> None:
        """The running requests as they stand at `step`; any other share is retired."""
        self.step = step
        if step - self._base > len(self._demand) // 2:  # drop the past
            kept = self._demand[step - self._base:]
            self._demand = np.zeros_like(self._demand)
            self._demand[:len(kept)] = kept
            self._base = step
        seen = set()
        for request_id, outlook in running:
            seen.add(request_id)
            self.update(request_id, outlook)
        for request_id in [r for r in self._shares if r not in seen]:
            self.retire(request_id)

    def update(self, request_id: str, outlook: Outlook) -> None:
        """A running request as it stands at this step."""
        schedule = outlook.schedule
        pending = outlook.total - outlook.computed
        # Everything its steps ahead depend on, in absolute steps; its blocks
        # now only matter while it prefills (after: step 0 alone).
        key = (outlook.total - self.step, outlook.computed - self.step, outlook.final, schedule.version,
               outlook.held if pending > 1 else None)
        share = self._shares.get(request_id)
        self.updates += 1
        if share is not None and share.key == key and share.schedule is schedule:
            since = self.step - share.built
            if share.timeline.prefill:
                now = outlook.held
            elif 0 < since <= len(share.ahead):
                # A token a step since it was built: its blocks now are its
                # timeline's at this step (`now_at`, read from the array).
                now = max(outlook.held, int(share.ahead[since - 1]))
            else:
                now = share.timeline.now_at(outlook.held, outlook.total)
        else:
            held, now = 0, 0
            if share is not None:
                self._add(share, -1)
                held, now = share.held, share.now
            timeline = self.timeline(outlook, running=True)
            self.rebuilds += 1
            share = _Share(key, schedule, timeline, self.step, held, now, timeline.ahead())
            self._shares[request_id] = share
            self._add(share, 1)
            now = timeline.now
        self._now += now - share.now
        self._held += outlook.held - share.held
        share.now, share.held = now, outlook.held

    def retire(self, request_id: str) -> None:
        share = self._shares.pop(request_id, None)
        if share is not None:
            self._add(share, -1)
            self._now -= share.now
            self._held -= share.held

    def admits(self, outlook: Outlook, free_blocks: int) -> bool:
        """Whether a waiting request fits at every step ahead beside the
        running ones: `free_blocks` free (less the watermark) and the blocks
        they hold."""
        capacity = free_blocks + self._held
        # The most it could hold at any step fits beside the running
        # requests' most: admitted without its timeline (most checks where
        # memory is not short).
        most = self.most_blocks(outlook.final)
        if self._now + most <= capacity and self._peak_ahead() + most <= capacity:
            return True
        timeline = self.timeline(outlook, running=False)
        if self._now + timeline.now > capacity:
            return False
        first, last = self.step + 1, self.step + timeline.last_step
        if last >= first:
            demand: np.ndarray = np.zeros(last - first + 1, dtype=np.int64)
            present = self._demand[first - self._base: min(last + 1, self._end) - self._base]
            demand[:len(present)] = present
            if int((demand + timeline.ahead()).max()) > capacity:
                return False
        rest = self._demand[max(last + 1, first) - self._base: self._end - self._base]
        return rest.size == 0 or int(rest.max()) <= capacity

    def most_blocks(self, final: int) -> int:
        """The most blocks a request ending at `final` tokens can ever hold:
        every token in every group (no timeline holds more)."""
        return self.num_groups * cdiv(final, self.block_size)

    def _peak_ahead(self) -> int:
        """The most the running requests hold at any step after this one."""
        key = (self.step, self._changes)
        if self._peak is None or self._peak[0] != key:
            ahead = self._demand[self.step + 1 - self._base: self._end - self._base]
            self._peak = (key, int(ahead.max()) if ahead.size else 0)
        return self._peak[1]

    def _add(self, share: _Share, sign: int) -> None:
        """Add a share's steps ahead into the demand (sign -1: take them out)."""
        timeline = share.timeline
        self._changes += 1
        first, last = share.built + 1, share.built + timeline.last_step
        lo = max(first, self._base, self.step + 1 if sign < 0 else first)
        if last < lo:
            return
        if last + 1 - self._base > len(self._demand):
            grown: np.ndarray = np.zeros(max(2 * len(self._demand), last + 1 - self._base), dtype=np.int64)
            grown[:len(self._demand)] = self._demand
            self._demand = grown
        self._demand[lo - self._base: last + 1 - self._base] += sign * share.ahead[lo - first:]
        self._end = max(self._end, last + 1)
