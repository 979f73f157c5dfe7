"""StreamingLLM: attention sinks + the most recent tokens; evict the middle."""

from dataclasses import dataclass, field

import torch

from .base import Observation, Policy, register_policy


@register_policy
@dataclass
class StreamingLLM(Policy):
    name = "streamingllm"
    rolling = True
    same_selection_in_every_layer = True

    sink_tokens: int = field(default=4, metadata={"help": "first tokens always kept (attention sinks)"})
    prompt_chunk: int = field(default=0, metadata={
        "help": "stream the prompt: evict every this many prefilled tokens, so a request holds at most "
                "budget + prompt_chunk tokens while prefilling (0: prefill the whole prompt, then evict)"})

    def validate(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.prompt_chunk < 0:
            raise ValueError(f"prompt_chunk must be >= 0, got {self.prompt_chunk}")

    def prompt_chunk_size(self) -> int:
        return self.prompt_chunk

    def protected(self, budget: int) -> tuple[int, int]:
        return self.sink_tokens, budget - self.sink_tokens

    def min_budget(self) -> int:
        return self.sink_tokens + 1

    def score(self, obs: Observation) -> torch.Tensor:
        # Everything kept is protected; newer is better for anything else.
        return obs.positions.to(torch.float32)


@register_policy
@dataclass
class Window(StreamingLLM):
    """Window attention: StreamingLLM without sinks (a baseline that collapses)."""

    name = "window"

    sink_tokens: int = field(default=0, metadata={"help": "first tokens always kept"})
