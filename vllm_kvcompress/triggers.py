"""Triggers: when a request compresses.

  once      at the end of prefill, if the prompt is over budget
  rolling   at the end of prefill, then whenever the cache has grown by
            `interval` tokens past the budget (bulk eviction, a block at a time)
  streamed  rolling, and also every `prompt_chunk` prompt tokens while the
            prompt is prefilled (only scorers that observe no attention: no
            later query can change their choice)
  decode    rolling over generated tokens only: the prompt stays whole (it is
            the protected start, and `budget` counts generated tokens), the
            regime of long generations (R-KV, TriAttention); it composes with
            prefix caching completely, as no prompt block is ever rewritten
  once_window  once at the end of prefill, then rolling over generated tokens
            only: the compressed prompt stays whole and the newest
            `decode_window` generated tokens are kept (plus up to an interval),
            so a long answer holds the prompt's budget plus a window, not
            every output (kvpress's prefill press followed by a decoding press)

Each trigger owns its rule: the schedule (schedule.py) keeps a request's
lengths per KV cache group and asks the trigger whether a compression is due
and where a step's tokens must stop; it never branches on the trigger's kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .compat import Component, Problem, first_problem
from .limits import bounded

if TYPE_CHECKING:
    from .config import KVCompressConfig
    from .registry import Components


@dataclass(frozen=True)
class Hold:
    """Tokens a request holds past its prompt, as a function of its total
    length L: min(L + offset, cap), a term left out where it is None. Every
    trigger's hold has this shape, so admission can forecast many requests'
    blocks over many steps at once (admission.py) from the same formula."""

    offset: int | None
    cap: int | None

    def at(self, total_len: int) -> int:
        if self.offset is None:
            assert self.cap is not None, "a hold has a slope, a cap or both"
            return self.cap
        return total_len + self.offset if self.cap is None else min(total_len + self.offset, self.cap)

    def at_each(self, total_lens: np.ndarray) -> np.ndarray:
        """`at` of every length in an integer array (the same line, for a forecast of many steps)."""
        if self.offset is None:
            assert self.cap is not None, "a hold has a slope, a cap or both"
            return np.full_like(total_lens, self.cap)
        held: np.ndarray = total_lens + self.offset
        return held if self.cap is None else np.minimum(held, self.cap)


@dataclass(frozen=True)
class Trigger(Component):
    """When a request compresses. `over`: how far the fullest KV cache group
    is past its budget; `room`: how many tokens the first group to fill can
    still take before it is an interval past its budget."""

    def protected_len(self, prompt_len: int) -> int:
        """Leading tokens it never evicts (the budget counts the tokens after them)."""
        return 0

    def chunk_size(self) -> int:
        """Prompt tokens prefilled between evictions; 0: the whole prompt first."""
        return 0

    def due_in_prompt(self, over: int) -> bool:
        """Whether a prompt still being prefilled compresses now."""
        return False

    def repeats(self) -> bool:
        """Whether the request compresses again after its prompt (and so keeps observing)."""
        return False

    def due_after_prompt(self, over: int, interval: int) -> bool:
        """Whether a request past its prompt's compression compresses now
        (only asked of a trigger that `repeats`)."""
        return False

    def tokens_until_due(self, room: int) -> int | None:
        """Most tokens a step past the prompt may compute before the next compression (None: no limit)."""
        return None

    def held_after_prompt(self, budget: int, prompt_len: int, total_len: int, interval: int) -> int:
        """Most tokens a request holds while it computes up to `total_len` tokens past its prompt."""
        return self.hold_after_prompt(budget, prompt_len, interval).at(total_len)

    def hold_after_prompt(self, budget: int, prompt_len: int, interval: int) -> Hold:
        """`held_after_prompt` as a line in the total length: the budget and
        every output (a token more per token computed)."""
        return Hold(offset=min(budget, prompt_len) - prompt_len, cap=None)

    def budget_after_prompt(self, budget: int, prompt_len: int) -> int:
        """The tokens a request past its prompt compresses back to: the prompt's budget,
        unless the trigger gives generated tokens room of their own."""
        return budget

    def protected_after_prompt(self, prompt_len: int) -> tuple[int, int] | None:
        """(sinks, recent) a compression past the prompt keeps whatever the scores
        (logical positions below `sinks`, the `recent` newest); None: the scorer's."""
        return None


class Once(Trigger):  # no parameters: the base's dataclass serves
    name = "once"


class Rolling(Trigger):
    name = "rolling"

    def repeats(self) -> bool:
        return True

    def due_after_prompt(self, over: int, interval: int) -> bool:
        return over >= interval

    def tokens_until_due(self, room: int) -> int | None:
        return max(room, 1)

    def hold_after_prompt(self, budget: int, prompt_len: int, interval: int) -> Hold:
        return Hold(offset=None, cap=budget + interval)


@dataclass(frozen=True)
class Streamed(Rolling):
    name = "streamed"

    prompt_chunk: int = field(default=128, metadata=bounded(
        1, "tokens", help="streamed: evict every this many prefilled prompt tokens, so a request holds at most "
                          "budget + prompt_chunk tokens while prefilling"))

    def validate(self) -> None:
        if self.prompt_chunk < 1:
            raise ValueError(f"prompt_chunk must be >= 1, got {self.prompt_chunk}")

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        observe = parts.scorer.observe
        return first_problem(
            (observe.attends(), "trigger",
             f"'streamed' evicts mid-prompt, which only scorers that observe no attention can do (streamingllm, "
             f"window, random); scorer {parts.scorer.name!r} observes {observe.value} queries"))

    def chunk_size(self) -> int:
        return self.prompt_chunk

    def due_in_prompt(self, over: int) -> bool:
        return over >= self.prompt_chunk


class DecodeOnly(Rolling):
    name = "decode"

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        return first_problem(
            (parts.scorer.observe.prompt_only(), "trigger",
             f"'decode' compresses generated tokens only, and scorer {parts.scorer.name!r} observes only the "
             f"prompt's last queries; valid with it: scorers that observe decode queries or none (h2o, tova, "
             f"keyformer, rkv, streamingllm, random)"),
            (config.compression_ratio is not None, "compression_ratio",
             "trigger 'decode' keeps the prompt whole; give budget, the generated tokens kept"))

    def protected_len(self, prompt_len: int) -> int:
        return prompt_len


@dataclass(frozen=True)
class OnceThenWindow(Rolling):
    name = "once_window"

    decode_window: int = field(default=128, metadata=bounded(
        1, "tokens", help="once_window: generated tokens kept after the compressed prompt (the newest); "
                          "a request holds its budget + decode_window + up to an interval"))

    def validate(self) -> None:
        if self.decode_window < 1:
            raise ValueError(f"decode_window must be >= 1, got {self.decode_window}")

    def hold_after_prompt(self, budget: int, prompt_len: int, interval: int) -> Hold:
        kept = min(budget, prompt_len)
        return Hold(offset=kept - prompt_len, cap=kept + self.decode_window + interval)

    def budget_after_prompt(self, budget: int, prompt_len: int) -> int:
        return min(budget, prompt_len) + self.decode_window

    def protected_after_prompt(self, prompt_len: int) -> tuple[int, int] | None:
        # Every prompt token left (the prompt's compression chose them) and
        # the window: together exactly what the request keeps, so past the
        # prompt the scores choose nothing and the window slides.
        return prompt_len, self.decode_window


TRIGGERS: dict[str, type[Trigger]] = {cls.name: cls for cls in (Once, Rolling, Streamed, DecodeOnly, OnceThenWindow)}
