"""Scorers, by name: what each observes and how it scores a layer's cached tokens."""

from .base import LogitsNoise, Observation, Observe, Scorer, hash_uniform
from .h2o import H2O
from .keep_all import KeepAll
from .keyformer import Keyformer
from .random import Random
from .rkv import RKV
from .snapkv import SnapKV
from .streamingllm import StreamingLLM
from .tova import TOVA

SCORERS: dict[str, type[Scorer]] = {cls.name: cls for cls in (SnapKV, H2O, TOVA, Keyformer, StreamingLLM, Random, RKV,
                                                                KeepAll)}

__all__ = ["SCORERS", "LogitsNoise", "Observation", "Observe", "Scorer", "hash_uniform"]
