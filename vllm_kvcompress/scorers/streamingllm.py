"""StreamingLLM: attention sinks + the most recent tokens; evict the middle."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..limits import bounded
from .base import Observation, Scorer, check_at_least


@dataclass(frozen=True)
class StreamingLLM(Scorer):
    name = "streamingllm"

    sink_tokens: int = field(default=4, metadata=bounded(0, "tokens",
                                                         help="first tokens always kept (attention sinks)"))

    def validate(self) -> None:
        check_at_least("sink_tokens", self.sink_tokens, 0)

    def protected(self, budget: int) -> tuple[int, int]:
        return self.sink_tokens, budget - self.sink_tokens

    def min_budget(self) -> int:
        return self.sink_tokens + 1

    def scores_key(self, layer: int) -> int:
        return 0  # positions alone: the same scores in every layer

    def score(self, obs: Observation) -> torch.Tensor:
        # Everything kept is protected; newer is better for anything else.
        return obs.positions.to(torch.float32)
