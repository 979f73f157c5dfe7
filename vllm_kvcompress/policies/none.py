"""`none`: the plugin's plumbing without compression (keeps everything)."""

from dataclasses import dataclass

from .base import Policy, register_policy


@register_policy
@dataclass
class NoCompression(Policy):
    name = "none"
