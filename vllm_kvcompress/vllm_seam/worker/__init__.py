"""Worker side, by job (state.py says what runs when in a step):

  state.py             WorkerCompression: per-request states, failures, the step's start
  step_inputs.py       physical slots and seq_lens, metadata edits, the step's requests
  attention_passes.py  after vLLM's attention of a layer: masked heads, merged
                       layers, fused decode, observed scores
  compaction.py        the step's evictions, every layer, before new blocks are written
  startup.py           layout self-test, exactness checks, tensor parallelism, memory
  hooks.py             the vLLM methods wrapped (patches.py lists them)
"""

from .compaction import FAULT_ENV
from .state import WorkerCompression

__all__ = ["FAULT_ENV", "WorkerCompression"]
