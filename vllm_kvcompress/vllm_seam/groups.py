"""Per-layer KV cache groups: the layers split into tiers, each with its own block table.

vLLM puts all full-attention layers of a model in one KV cache group (one
block table per request), so a per-layer budget could only free memory down
to the largest layer's. With `layer_groups` set, the engine core builds that
many groups instead (contiguous tiers of equal size over one block pool, the
way vLLM's hybrid manager runs sliding-window models), and each group's
physical length follows its own budget.

Split or not, the full-attention groups leave here with
`CompressedAttentionSpec` (see block_manager.py), so that vLLM gives each one
a manager that allocates by physical length. On hybrid models (Gemma 2/3:
sliding-window layers beside full-attention ones) only the full-attention
layers compress and split; the sliding-window groups keep vLLM's manager.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

from ..config import CONFIG_KEY, KVCompressConfig, KVCompressConfigError
from ..schedule import layer_groups

# vLLM's DraftModelProposer builds the draft model under this prefix
# (`get_model(..., prefix="draft_model")`): its attention layers sit in the
# target's first KV cache group, with the target's block tables.
DRAFT_PREFIX = "draft_model."


def is_draft_layer(layer_name: str) -> bool:
    return layer_name.startswith(DRAFT_PREFIX)


def layer_index(layer_name: str) -> int:
    match = re.search(r"\.(\d+)\.", layer_name)
    if match is None:
        raise ValueError(f"kv_compress: cannot find a layer index in {layer_name!r}")
    return int(match.group(1))


@dataclasses.dataclass(frozen=True)
class CompressedLayers:
    """Which attention layers compress, and in which KV cache groups.

    Full-attention layers compress; sliding-window layers (hybrid models such
    as Gemma 2/3) stay with vLLM's own sliding-window manager, which already
    drops what falls out of their window. Planner, worker state and reference
    decoder count only the compressed layers: "layer i" and "group g" in the
    plan mean the i-th compressed layer and the g-th compressed group, in
    model order. A draft model's layers (speculative decoding) are none of
    them: they ride in vLLM's group 0 and follow its compactions
    (worker/speculation.DraftLayer).
    """

    vllm_groups: tuple[int, ...]  # compressed group g -> vLLM's KV cache group id
    layers: tuple[int, ...]  # compressed layer i -> the model's attention layer index
    group_of_layer: tuple[int, ...]  # compressed layer i -> compressed group g
    num_vllm_groups: int

    @classmethod
    def from_groups(cls, kv_cache_groups) -> CompressedLayers:
        from .block_manager import CompressedAttentionSpec

        compressed = [g for g, group in enumerate(kv_cache_groups) if _is_compressed(group.kv_cache_spec,
                                                                                      CompressedAttentionSpec)]
        layer_group = {layer_index(name): i for i, g in enumerate(compressed)
                       for name in kv_cache_groups[g].layer_names if not is_draft_layer(name)}
        all_layers = sorted(layer_index(name) for group in kv_cache_groups for name in group.layer_names
                            if not is_draft_layer(name))
        if all_layers != list(range(len(all_layers))):
            raise RuntimeError(f"kv_compress: unexpected attention layer indices {all_layers}")
        layers = tuple(sorted(layer_group))
        return cls(vllm_groups=tuple(compressed), layers=layers,
                   group_of_layer=tuple(layer_group[i] for i in layers), num_vllm_groups=len(kv_cache_groups))


def _is_compressed(spec, compressed_type) -> bool:
    if isinstance(spec, compressed_type):
        return True
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if not inner:
        return False
    return all(isinstance(s, compressed_type) for s in inner.values())


def wrap_get_kv_cache_groups(original):
    def get_kv_cache_groups(vllm_config, kv_cache_spec):
        groups = original(vllm_config, kv_cache_spec)
        raw = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        if raw is None:
            return groups
        # Beside the original: vllm.v1.core.kv_cache_utils on 0.32, kv_cache_planning from 0.33 on.
        create_kv_cache_group_specs = importlib.import_module(original.__module__).create_kv_cache_group_specs
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MambaSpec,
            SlidingWindowSpec,
            UniformTypeKVCacheSpecs,
        )

        from .block_manager import compressed_spec, register_compressed_spec

        register_compressed_spec(vllm_config)
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]

        def full(spec) -> bool:
            # Exactly FullAttentionSpec: its subclasses (MLA, sinks, ...) lay
            # out or manage their cache their own way (engine_args refuses
            # them). A full spec with a window is a sliding-window layer that
            # --disable-hybrid-kv-cache-manager merged into the full group:
            # compacting it would move tokens across its window.
            if isinstance(spec, UniformTypeKVCacheSpecs):
                return all(full(s) for s in spec.kv_cache_specs.values())
            if type(spec) is not FullAttentionSpec:
                return False
            if spec.sliding_window is not None or spec.attention_chunk_size is not None:
                raise KVCompressConfigError(
                    f"{CONFIG_KEY}: sliding-window layers merged into full-attention groups "
                    f"(--disable-hybrid-kv-cache-manager); leave vLLM's hybrid KV cache manager on")
            return True

        def compressed(spec):
            if isinstance(spec, UniformTypeKVCacheSpecs):
                # Layers of different shapes in one group: the scheduler's
                # config keeps one of them, the workers each layer's own.
                return dataclasses.replace(
                    spec, kv_cache_specs={n: compressed_spec(s) for n, s in spec.kv_cache_specs.items()})
            return compressed_spec(spec)

        for g in groups:
            # Beside them, vLLM keeps its own managers: sliding-window groups,
            # and the Mamba-style state of Gated DeltaNet layers (engine_checks
            # admits no other state-space hybrid).
            if not full(g.kv_cache_spec) and type(g.kv_cache_spec) not in (SlidingWindowSpec, MambaSpec):
                raise KVCompressConfigError(
                    f"{CONFIG_KEY}: needs full-attention KV cache groups (sliding-window or Gated DeltaNet ones "
                    f"may sit beside them), this model has {kinds}")
        if not any(full(g.kv_cache_spec) for g in groups):
            raise KVCompressConfigError(f"{CONFIG_KEY}: this model has no full-attention layers to compress "
                                        f"(KV cache groups {kinds})")

        wanted = KVCompressConfig.from_dict(raw).num_layer_groups
        if wanted != 1:
            groups = _split(groups, wanted, full, kv_cache_spec, create_kv_cache_group_specs)
        # The spec picks the manager (vLLM's KVCacheSpecRegistry): this one
        # allocates by physical length and frees evicted tails. Sliding-window
        # groups keep vLLM's own manager.
        return [dataclasses.replace(g, kv_cache_spec=compressed(g.kv_cache_spec)) if full(g.kv_cache_spec) else g
                for g in groups]

    return get_kv_cache_groups


def _split(groups, wanted: int, full, kv_cache_spec, create_kv_cache_group_specs):
    """`wanted` contiguous tiers of the full-attention layers; sliding-window
    layers regrouped to the tiers' size (vLLM's hybrid layout wants groups of
    one size: a group's layer i shares memory with every other group's)."""
    full_names = sorted((n for g in groups if full(g.kv_cache_spec) for n in g.layer_names if not is_draft_layer(n)),
                        key=layer_index)
    other_names = sorted((n for g in groups if not full(g.kv_cache_spec) for n in g.layer_names), key=layer_index)
    # A draft model's layers all in the first tier: vLLM's draft proposer
    # builds its metadata from group 0's (and wants its layers in one group).
    draft_names = [n for g in groups if full(g.kv_cache_spec) for n in g.layer_names if is_draft_layer(n)]
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if [type(g.kv_cache_spec) for g in groups if full(g.kv_cache_spec)] != [FullAttentionSpec] or len({
            type(g.kv_cache_spec) for g in groups if not full(g.kv_cache_spec)}) > 1:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise KVCompressConfigError(
            f"{CONFIG_KEY}.layer_groups: needs one group of full-attention layers to split, this model has {kinds}")
    try:
        tiers = layer_groups(len(full_names), wanted)
    except ValueError as e:
        raise KVCompressConfigError(str(e)) from None
    size = len(full_names) // wanted
    partition = [[n for n, t in zip(full_names, tiers) if t == g] for g in range(wanted)]
    partition[0] += draft_names
    partition += [other_names[i: i + size] for i in range(0, len(other_names), size)]
    return create_kv_cache_group_specs(kv_cache_spec, partition)
