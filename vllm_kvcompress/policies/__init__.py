"""Compression policies, registered by name. Importing this package loads them all."""

from . import adakv, adaptive, h2o, keyformer, none, pyramidkv, random_eviction, snapkv, streamingllm, tova  # noqa: F401  (registration)
from .base import POLICIES, Observation, Observe, Policy, rank_scores, register_policy, select_keep, select_keep_per_head

__all__ = ["POLICIES", "Observation", "Observe", "Policy", "rank_scores", "register_policy", "select_keep",
           "select_keep_per_head"]
