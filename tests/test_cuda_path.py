"""The CUDA path on CPU: FLASH_ATTN metadata per KV cache group (built by vLLM 0.32's own
runner code on CPU tensors) and the engine settings chosen on CUDA (piecewise CUDA graphs).

On CUDA vLLM's runner builds the first KV cache group of a spec and copies its
metadata to the next groups of that spec, changing only the block table
(`update_block_table`): every group would get group 0's seq_lens. Compressed
groups hold different physical lengths (per-layer budgets, MiniCache, hybrid
models), so the plugin's FLASH_ATTN builder builds each group. Here
`GPUModelRunner._build_attention_metadata` itself runs on a stand-in runner
with two compressed groups of different lengths, once with vLLM's builder
(the lengths are shared: the failure this guards against) and once with the
plugin's (each group's own lengths), FlashAttention's real builder on CPU.
"""

from __future__ import annotations

import types

import pytest
import torch

from vllm_kvcompress.config import CONFIG_KEY, KVCompressConfig
from vllm_kvcompress.vllm_seam import patches
from vllm_kvcompress.vllm_seam.worker import step_inputs
from vllm_kvcompress.vllm_seam.worker.state import attach

LAYERS = [["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]]
GROUP0_LENS = [40, 9, 70]  # physical lengths in group 0, the runner's seq_lens
DELTAS = [5, -20, 30]  # group 1 holds this much less (negative: more) per request


@pytest.fixture(scope="module")
def vllm_config(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    patches.apply_all()  # the seam, as the plugin entry point installs it
    return EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, block_size=32).create_engine_config()


def build_groups(vllm_config, backend, edits):
    """Each group's FlashAttentionMetadata, as vLLM's runner builds them for one
    step of three requests (a decode, a prompt chunk of 4, a decode)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_kvcompress.vllm_seam.block_manager import compressed_spec

    spec = compressed_spec(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32))
    worker = types.SimpleNamespace(metadata_edits=edits)
    attn_groups = []
    for gid, names in enumerate(LAYERS):
        group = AttentionGroup(backend=backend, layer_names=names, kv_cache_spec=spec, kv_cache_group_id=gid)
        group.create_metadata_builders(vllm_config, torch.device("cpu"))
        attach(group, worker)
        attn_groups.append([group])
    tables = [torch.arange(g * 100, g * 100 + 3 * 4, dtype=torch.int32).view(3, 4) for g in range(2)]
    query_start = torch.tensor([0, 1, 5, 6], dtype=torch.int32)
    seq_lens = torch.tensor(GROUP0_LENS, dtype=torch.int32)
    runner = types.SimpleNamespace(
        kv_cache_config=types.SimpleNamespace(
            kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names in LAYERS]),
        optimistic_seq_lens_cpu=seq_lens.clone(),
        input_batch=types.SimpleNamespace(
            block_table=[types.SimpleNamespace(get_device_tensor=lambda n, t=t: t[:n]) for t in tables],
            num_computed_tokens_cpu_tensor=seq_lens - torch.tensor([1, 4, 1], dtype=torch.int32),
            num_prompt_tokens_cpu_tensor=torch.tensor([10, 60, 20], dtype=torch.int32)),
        is_mm_prefix_lm=False, model_config=types.SimpleNamespace(rswa_window=None),
        cache_config=types.SimpleNamespace(use_replayssm=False),
        query_start_loc=types.SimpleNamespace(gpu=query_start, cpu=query_start.clone()),
        seq_lens=seq_lens, positions=torch.zeros(6, dtype=torch.int64), dcp_world_size=1,
        attn_groups=attn_groups, speculative_config=None, device=torch.device("cpu"),
        _get_encoder_seq_lens=lambda *args, **kwargs: (None, None))
    slot_mappings = {g: torch.arange(6, dtype=torch.int64) + 1000 * g for g in range(2)}
    metadata, _ = GPUModelRunner._build_attention_metadata(runner, num_tokens=6, num_reqs=3, max_query_len=4,
                                                           slot_mappings=slot_mappings)
    return [metadata[names[0]] for names in LAYERS], tables


def test_flash_attn_metadata_follows_each_compressed_groups_length(vllm_config, monkeypatch):
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionMetadata

    from vllm_kvcompress.vllm_seam.attention import KVCompressFlashBackend

    none = torch.tensor([], dtype=torch.int64)
    edits = step_inputs.MetadataEdits(3, {1: torch.tensor(DELTAS, dtype=torch.int32)}, none, none, frozenset({0, 1}))
    group1 = [n - d for n, d in zip(GROUP0_LENS, DELTAS)]

    # vLLM's builder: group 1 is a copy of group 0's metadata with its block table swapped in.
    plain, tables = build_groups(vllm_config, FlashAttentionBackend, edits)
    assert plain[1].seq_lens.tolist() == GROUP0_LENS != group1

    monkeypatch.setattr(vllm_config, "additional_config", {CONFIG_KEY: KVCompressConfig().to_dict()})
    built, tables = build_groups(vllm_config, KVCompressFlashBackend, edits)
    assert all(isinstance(m, FlashAttentionMetadata) for m in built)
    assert built[0].seq_lens.tolist() == GROUP0_LENS and built[0].max_seq_len == max(GROUP0_LENS)
    # max_seq_len stays an upper bound (FlashAttention takes one; no read-back of device lengths).
    assert built[1].seq_lens.tolist() == group1 and built[1].max_seq_len >= max(group1)
    for g in range(2):
        assert torch.equal(built[g].block_table, tables[g])
        assert built[g].slot_mapping.tolist() == [1000 * g + i for i in range(6)]

    # Fused decode rows attend one key in the compressed groups (rows 0 and 2 decode).
    rows = torch.tensor([0, 2])
    fused = step_inputs.MetadataEdits(3, {1: torch.tensor(DELTAS, dtype=torch.int32)}, rows, rows, frozenset({0, 1}))
    built, _ = build_groups(vllm_config, KVCompressFlashBackend, fused)
    assert built[0].seq_lens.tolist() == [1, GROUP0_LENS[1], 1]
    assert built[1].seq_lens.tolist() == [1, group1[1], 1]


def test_model_runner_v2_flash_attn_metadata_follows_each_group_from_logical_lengths(vllm_config, monkeypatch):
    """Model Runner V2 builds every group's metadata in `attn_utils.build_attn_metadata`
    from shared seq_lens that stay logical (its sampler reads them): each
    compressed group's physical lengths, group 0's included, come from the
    plugin's absolute edits; vLLM's shared lengths are left as they were."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_kvcompress.vllm_seam.attention import KVCompressFlashBackend
    from vllm_kvcompress.vllm_seam.block_manager import compressed_spec

    monkeypatch.setattr(vllm_config, "additional_config", {CONFIG_KEY: KVCompressConfig().to_dict()})
    logical = [n + 100 for n in GROUP0_LENS]
    offsets = [[100, 100 + d] for d in DELTAS]  # per request: evicted tokens in groups 0 and 1
    none = torch.tensor([], dtype=torch.int64)
    edits = step_inputs.MetadataEdits(
        3, {g: torch.tensor([o[g] for o in offsets], dtype=torch.int32) for g in range(2)}, none, none,
        frozenset({0, 1}))
    spec = compressed_spec(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32))
    worker = types.SimpleNamespace(metadata_edits=edits)
    attn_groups = []
    for gid, names in enumerate(LAYERS):
        group = AttentionGroup(backend=KVCompressFlashBackend, layer_names=names, kv_cache_spec=spec,
                               kv_cache_group_id=gid)
        group.create_metadata_builders(vllm_config, torch.device("cpu"))
        attach(group, worker)
        attn_groups.append([group])
    seq_lens = torch.tensor(logical, dtype=torch.int32)
    query_start = torch.tensor([0, 1, 5, 6], dtype=torch.int32)
    tables = [torch.arange(g * 100, g * 100 + 3 * 8, dtype=torch.int32).view(3, 8) for g in range(2)]
    config = types.SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names in LAYERS])
    metadata = build_attn_metadata(
        attn_groups=attn_groups, num_reqs=3, num_tokens=6, query_start_loc_gpu=query_start,
        query_start_loc_cpu=query_start.clone(), max_query_len=4, seq_lens=seq_lens, max_seq_len=max(logical),
        block_tables=tables, slot_mappings=torch.arange(12, dtype=torch.int64).view(2, 6), kv_cache_config=config,
        seq_lens_cpu_upper_bound=seq_lens.clone())
    built = [metadata[names[0]] for names in LAYERS]
    assert all(isinstance(m, FlashAttentionMetadata) for m in built)
    assert built[0].seq_lens.tolist() == GROUP0_LENS
    assert built[1].seq_lens.tolist() == [n - d for n, d in zip(GROUP0_LENS, DELTAS)]
    assert all(m.max_seq_len >= max(m.seq_lens.tolist()) for m in built)
    assert seq_lens.tolist() == logical  # the sampler's lengths untouched


def test_flash_attn_builder_keeps_vllms_reuse_without_compression(vllm_config):
    """With the plugin installed and compression off, vLLM's behaviour is unchanged."""
    from vllm_kvcompress.vllm_seam.attention import KVCompressFlashBackend

    assert CONFIG_KEY not in (vllm_config.additional_config or {})
    built, _ = build_groups(vllm_config, KVCompressFlashBackend, None)
    assert [m.seq_lens.tolist() for m in built] == [GROUP0_LENS, GROUP0_LENS]
    assert KVCompressFlashBackend.get_builder_cls().supports_update_block_table  # vLLM's class default


@pytest.fixture
def on_cuda(monkeypatch):
    """vLLM's current platform seen as CUDA (the engine-argument decisions only)."""
    import vllm.platforms

    platform = types.SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True, device_name="cuda")
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)


def cuda_args(**overrides):
    from vllm.config import CompilationConfig

    args = dict(attention_backend=None, attention_config=None, compilation_config=CompilationConfig(),
                enforce_eager=False)
    args.update(overrides)
    return types.SimpleNamespace(**args)


@pytest.mark.parametrize("policy", [{"policy": "pyramidkv", "budget": 64, "layer_groups": 4},
                                    {"policy": "minicache", "layer_groups": 4}, {"policy": "snapkv", "budget": 64}])
def test_cuda_serves_layer_groups_with_piecewise_cuda_graphs(on_cuda, policy):
    from vllm.config import CUDAGraphMode

    from vllm_kvcompress.vllm_seam.engine_checks import prepare_platform

    args = cuda_args()
    prepare_platform(args, KVCompressConfig.from_dict(policy))  # per-layer groups no longer refused
    assert args.attention_backend == "FLASH_ATTN"
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert args.enforce_eager is False
    eager = cuda_args(enforce_eager=True)
    prepare_platform(eager, KVCompressConfig.from_dict(policy))
    assert eager.compilation_config.cudagraph_mode is None  # vLLM turns graphs off itself


def test_cuda_refuses_what_would_capture_attention(on_cuda):
    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from vllm_kvcompress.config import KVCompressConfigError
    from vllm_kvcompress.vllm_seam.engine_checks import check_cuda_graphs, prepare_platform

    with pytest.raises(KVCompressConfigError, match="attention backend TRITON_ATTN"):
        prepare_platform(cuda_args(attention_backend="TRITON_ATTN"), KVCompressConfig())
    for mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        args = cuda_args(compilation_config=CompilationConfig(cudagraph_mode=mode))
        prepare_platform(args, KVCompressConfig())  # the user's choice is kept, then refused by name
        with pytest.raises(KVCompressConfigError, match=f"cudagraph_mode={mode} "):
            check_cuda_graphs(args.compilation_config)
    # Piecewise as vLLM resolves it: the attention ops split the graph.
    resolved = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    resolved.set_splitting_ops_for_v1("allgather_reducescatter")
    check_cuda_graphs(resolved)
    captured = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE,
                                 splitting_ops=["vllm::mamba_mixer"])
    with pytest.raises(KVCompressConfigError, match="splitting_ops="):
        check_cuda_graphs(captured)
    check_cuda_graphs(CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE, splitting_ops=[]))
