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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .limits import bounded


@dataclass(frozen=True)
class Trigger:
    name: ClassVar[str]
    rolling: ClassVar[bool] = False
    # The whole prompt is protected: only tokens generated after it are evicted.
    keeps_prompt: ClassVar[bool] = False

    def validate(self) -> None:
        """Raise ValueError naming the field for impossible parameter values."""

    def chunk_size(self) -> int:
        """Prompt tokens prefilled between evictions; 0: the whole prompt first."""
        return 0


class Once(Trigger):  # no parameters: the base's dataclass serves
    name = "once"


class Rolling(Trigger):
    name = "rolling"
    rolling = True


@dataclass(frozen=True)
class Streamed(Trigger):
    name = "streamed"
    rolling = True

    prompt_chunk: int = field(default=128, metadata=bounded(
        1, "tokens", help="streamed: evict every this many prefilled prompt tokens, so a request holds at most "
                          "budget + prompt_chunk tokens while prefilling"))

    def validate(self) -> None:
        if self.prompt_chunk < 1:
            raise ValueError(f"prompt_chunk must be >= 1, got {self.prompt_chunk}")

    def chunk_size(self) -> int:
        return self.prompt_chunk


class DecodeOnly(Trigger):
    name = "decode"
    rolling = True
    keeps_prompt = True


TRIGGERS: dict[str, type[Trigger]] = {cls.name: cls for cls in (Once, Rolling, Streamed, DecodeOnly)}
