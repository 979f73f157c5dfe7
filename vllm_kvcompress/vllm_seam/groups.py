"""Per-layer KV cache groups: the layers split into tiers, each with its own block table.

vLLM puts all full-attention layers of a model in one KV cache group (one
block table per request), so a per-layer budget could only free memory down
to the largest layer's. With `layer_groups` set, the engine core builds that
many groups instead (contiguous tiers of equal size over one block pool, the
way vLLM's hybrid manager runs sliding-window models), and each group's
physical length follows its own budget.

Split or not, the groups leave here with `CompressedAttentionSpec` (see
block_manager.py), so that vLLM gives each one a manager that allocates by
physical length.
"""

from __future__ import annotations

import dataclasses
import re

from ..config import CONFIG_KEY, KVCompressConfig, KVCompressConfigError
from ..planner import layer_groups


def layer_index(layer_name: str) -> int:
    match = re.search(r"\.(\d+)\.", layer_name)
    if match is None:
        raise ValueError(f"kv_compress: cannot find a layer index in {layer_name!r}")
    return int(match.group(1))


def group_of_layer(kv_cache_groups) -> list[int]:
    """Layer index -> KV cache group, from a KVCacheConfig's groups."""
    groups = {layer_index(name): g for g, group in enumerate(kv_cache_groups) for name in group.layer_names}
    if sorted(groups) != list(range(len(groups))):
        raise RuntimeError(f"kv_compress: unexpected attention layer indices {sorted(groups)}")
    return [groups[i] for i in range(len(groups))]


def wrap_get_kv_cache_groups(original):
    def get_kv_cache_groups(vllm_config, kv_cache_spec):
        groups = original(vllm_config, kv_cache_spec)
        raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        if raw is None:
            return groups
        from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

        from .block_manager import compressed_spec, register_compressed_spec

        register_compressed_spec(vllm_config)

        def compressed(spec):
            # Exactly FullAttentionSpec: its subclasses (MLA, sinks, ...) lay
            # out or manage their cache their own way (engine_args refuses them).
            if type(spec) is FullAttentionSpec:
                return compressed_spec(spec)
            if isinstance(spec, UniformTypeKVCacheSpecs) and all(
                    type(s) is FullAttentionSpec for s in spec.kv_cache_specs.values()):
                # Layers of different shapes in one group: the scheduler's
                # config keeps one of them, the workers each layer's own.
                return dataclasses.replace(
                    spec, kv_cache_specs={n: compressed_spec(s) for n, s in spec.kv_cache_specs.items()})
            raise KVCompressConfigError(
                f"{CONFIG_KEY}: needs full-attention KV cache groups, "
                f"this model has {[type(g.kv_cache_spec).__name__ for g in groups]}")

        wanted = KVCompressConfig.from_dict(raw).num_layer_groups
        if wanted != 1:
            if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
                raise KVCompressConfigError(
                    f"{CONFIG_KEY}.layer_groups: needs one group of full-attention layers to split, "
                    f"this model has {[type(g.kv_cache_spec).__name__ for g in groups]}")
            names = sorted(groups[0].layer_names, key=layer_index)
            try:
                tiers = layer_groups(len(names), wanted)
            except ValueError as e:
                raise KVCompressConfigError(str(e)) from None
            partition = [[n for n, t in zip(names, tiers) if t == g] for g in range(wanted)]
            groups = create_kv_cache_group_specs(kv_cache_spec, partition)
        # The spec picks the manager (vLLM's KVCacheSpecRegistry): this one
        # allocates by physical length and frees evicted tails.
        return [dataclasses.replace(g, kv_cache_spec=compressed(g.kv_cache_spec)) for g in groups]

    return get_kv_cache_groups
