"""Compression policies, registered by name. Importing this package loads them all."""

from . import adaptive, h2o, keyformer, none, pyramidkv, random_eviction, snapkv, streamingllm, tova  # noqa: F401  (registration)
from .base import POLICIES, Observation, Observe, Policy, register_policy, select_keep

__all__ = ["POLICIES", "Observation", "Observe", "Policy", "register_policy", "select_keep"]
