"""The GPU harness without vLLM (kvc_tools.paged_decoder) on CPU: the worker's
CUDA-side parts on vLLM 0.32's FLASH_ATTN cache layout, driven by the planner,
must give the reference decoder's tokens and kept positions. On a GPU,
scripts/gpu_check.sh runs the same harness on CUDA against its CPU run."""

import pytest
import torch

from kvc_tools.paged_decoder import PagedDecoder, random_llama
from kvc_tools.reference_decoder import ReferenceDecoder
from vllm_kvcompress.config import KVCompressConfig

NUM_LAYERS = 4
NEW_TOKENS = 10
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, weights = random_llama(seed=3, num_hidden_layers=NUM_LAYERS)
    hf = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False, max_position_embeddings=4096))
    hf.load_state_dict(weights)
    path = tmp_path_factory.mktemp("paged-llama")
    hf.save_pretrained(path)
    return cfg, weights, ReferenceDecoder(str(path))


def prompts(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


CONFIGS = [
    [{"policy": "snapkv", "budget": 48, "window": 8}, {"policy": "snapkv", "selection": "span", "span": 6,
                                                        "sink_tokens": 2, "budget": 40, "window": 8}, None],
    [{"policy": "h2o", "budget": 40, "interval": 8}, {"policy": "tova", "budget": 36, "interval": 4},
     {"policy": "keyformer", "budget": 40, "window": 8, "interval": 8}],
    [{"policy": "adakv", "budget": 40, "window": 8}, {"policy": "h2o", "allocation": "per_head", "trigger": "once",
                                                       "budget": 48, "alpha": 0.3},
     {"policy": "adakv", "budget": 56, "window": 16, "alpha": 0.5}],
    [{"policy": "streamingllm", "budget": 32, "interval": 8},
     {"policy": "random", "trigger": "streamed", "prompt_chunk": 32, "budget": 40, "window": 4}, None],
]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("configs", CONFIGS, ids=["once", "rolling", "per-head", "streamed"])
def test_paged_harness_matches_reference(tiny, configs, layout):
    cfg, weights, reference = tiny
    batch = prompts((130, 97, 161), seed=len(str(configs)))
    kv = [KVCompressConfig.from_dict(c) if c else KVCompressConfig() for c in configs]
    got = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE, layout=layout).generate(batch, NEW_TOKENS, kv)
    for prompt, config, out in zip(batch, kv, got):
        want = reference.generate(prompt, NEW_TOKENS, config, block_size=BLOCK_SIZE)
        assert out["tokens"] == want["tokens"], config
        if want["kept_positions"] is None:
            assert out["kept_positions"] is None
        else:
            for got_pos, want_pos in zip(out["kept_positions"], want["kept_positions"]):
                assert torch.equal(got_pos.sort(-1).values, want_pos.sort(-1).values), config


def test_paged_harness_per_layer_groups_and_minicache(tiny):
    """One KV cache group per layer: per-layer budgets hold their own blocks,
    MiniCache pairs merge (the upper layer's attention through merged_attention)."""
    cfg, weights, reference = tiny
    batch = prompts((150, 120), seed=11)
    kv = [KVCompressConfig.from_dict({"policy": "pyramidkv", "budget": 48, "window": 8, "layer_groups": NUM_LAYERS}),
          KVCompressConfig.from_dict({"policy": "minicache", "start_layer": 2, "retain_ratio": 0.1,
                                      "layer_groups": NUM_LAYERS})]
    got = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE).generate(batch, NEW_TOKENS, kv)
    for prompt, config, out in zip(batch, kv, got):
        want = reference.generate(prompt, NEW_TOKENS, config, block_size=BLOCK_SIZE)
        assert out["tokens"] == want["tokens"], config.policy
    pyramid_blocks = got[0]["blocks"]
    assert len(set(pyramid_blocks)) > 1  # layers hold different lengths, hence blocks


PER_LAYER = [{"policy": "pyramidkv", "budget": 48, "window": 8, "layer_groups": NUM_LAYERS},
             {"policy": "minicache", "start_layer": 2, "retain_ratio": 0.1, "layer_groups": NUM_LAYERS},
             {"policy": "adakv", "budget": 40, "window": 8, "layer_groups": NUM_LAYERS}]
# A hybrid model (Gemma 3's shape): sliding-window layers 0 and 2 are vLLM's KV cache group 0,
# uncompressed; full-attention layers 1 and 3 compress, one KV cache group each.
HYBRID_SHAPE = dict(layer_types=["sliding_attention", "full_attention"] * (NUM_LAYERS // 2), sliding_window=24)
HYBRID = [{"policy": "pyramidkv", "budget": 40, "window": 8, "layer_groups": 2},
          {"policy": "h2o", "budget": 36, "interval": 8, "layer_groups": 2},
          {"policy": "snapkv", "selection": "span", "span": 6, "budget": 40, "window": 8, "layer_groups": 2}]
EVERY = [*CONFIGS, PER_LAYER, HYBRID]
EVERY_ID = ["once", "rolling", "per-head", "streamed", "per-layer", "hybrid"]


def harness_model(configs, seed=5, num_layers=NUM_LAYERS):
    """(config, weights, batch configs) of the random Llama a configuration set runs on."""
    shape = HYBRID_SHAPE if configs is HYBRID else {}
    cfg, weights = random_llama(seed=seed, num_hidden_layers=num_layers, **shape)
    return cfg, weights, [KVCompressConfig.from_dict(c) if c else KVCompressConfig() for c in configs]


def test_paged_harness_hybrid_keeps_sliding_layers_whole():
    """Sliding-window layers (vLLM's group 0) keep every block; the compressed
    groups hold fewer; with budgets above the need the answers are the
    uncompressed model's."""
    cfg, weights, kv = harness_model(HYBRID)
    batch = prompts((130, 97, 161), seed=9)
    decoder = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE)
    got = decoder.generate(batch, NEW_TOKENS, kv)
    plain = decoder.generate(batch, NEW_TOKENS, None)
    roomy = decoder.generate(batch, NEW_TOKENS, KVCompressConfig.from_dict(
        {"policy": "h2o", "budget": 400, "interval": 8, "layer_groups": 2}))
    assert [r["tokens"] for r in roomy] == [r["tokens"] for r in plain]
    for prompt, out in zip(batch, got):
        sliding, *compressed = out["blocks"]
        assert sliding == -(-(len(prompt) + NEW_TOKENS - 1) // BLOCK_SIZE) and max(compressed) < sliding


def test_paged_harness_admits_by_blocks_and_chunks_prompts_without_changing_tokens():
    """With a pool that holds few whole requests and a token budget per step,
    requests wait for blocks and prompts are chunked (as vLLM schedules them),
    and every answer equals the run with room for all at once; compressed
    requests, needing fewer blocks after their prompt, are admitted sooner."""
    cfg, weights = random_llama(seed=5, num_hidden_layers=NUM_LAYERS)
    batch = prompts((120,) * 6, seed=4)
    decoder = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE)
    small = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE, num_blocks=8 * 3)
    for config in (None, KVCompressConfig.from_dict({"policy": "snapkv", "budget": 32, "window": 8})):
        roomy = decoder.generate(batch, NEW_TOKENS, config)
        tight = small.generate(batch, NEW_TOKENS, config, max_batched_tokens=64)
        assert [r["tokens"] for r in tight] == [r["tokens"] for r in roomy]
        assert all(r["admitted"] == 0 for r in roomy)
        if config is None:
            plain_admitted = [r["admitted"] for r in tight]
        else:
            assert [r["admitted"] for r in tight] < plain_admitted  # the pool is free sooner
    assert plain_admitted[-1] > 0  # the pool did hold requests back


def _triton_ops_on_cpu():
    """The Triton ops, run by Triton's interpreter on CPU tensors (None when
    this process already compiled them for a GPU)."""
    import os
    import sys

    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
    from vllm_kvcompress.kernels import triton_ops

    ops = triton_ops()
    module = sys.modules["vllm_kvcompress.kernels.triton_compact"]
    return ops if type(module._compact_kernel).__name__ == "InterpretedFunction" else None


@pytest.mark.extended
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the CUDA test below runs the compiled kernels")
@pytest.mark.parametrize("configs", EVERY, ids=EVERY_ID)
def test_paged_harness_with_triton_ops_equals_torch_ops(configs):
    """What the worker runs on CUDA (the Triton ops, called with the worker's
    own arguments: scores buffers, fused decode rows, compaction tables,
    per-head masks, merged layers), interpreted on CPU, gives the torch ops'
    tokens, kept positions and blocks."""
    ops = _triton_ops_on_cpu()
    if ops is None:
        pytest.skip("Triton kernels already compiled for a GPU in this process")
    # The interpreter runs each kernel program in Python: two layers where one
    # KV cache group holds them all (every kernel still runs at a layer above
    # 0), four where each layer is its own group or the model is hybrid.
    per_layer = configs is PER_LAYER or configs is HYBRID
    cfg, weights, kv = harness_model(configs, num_layers=NUM_LAYERS if per_layer else 2)
    batch = prompts((90, 61, 75), seed=7)
    torch_run = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE).generate(batch, NEW_TOKENS, kv)
    triton_run = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE, ops=ops).generate(batch, NEW_TOKENS, kv)
    for config, t, c in zip(kv, triton_run, torch_run):
        assert t["tokens"] == c["tokens"], config
        assert t["blocks"] == c["blocks"], config
        if c["kept_positions"] is not None:
            for tp, cp in zip(t["kept_positions"], c["kept_positions"]):
                assert torch.equal(tp.sort(-1).values, cp.sort(-1).values), config


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it there)")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_harness_on_cuda_equals_cpu_without_host_syncs(layout):
    """The CUDA path (Triton ops, device-resident scores and masks) gives the
    CPU path's tokens and kept positions, and neither its per-layer hooks nor
    its compactions wait for the device (torch.cuda.set_sync_debug_mode('error')
    around them)."""
    batch = prompts((130, 97, 161), seed=7)
    for configs in EVERY:
        cfg, weights, kv = harness_model(configs)
        cpu = PagedDecoder(cfg, weights, block_size=BLOCK_SIZE, layout=layout).generate(batch, NEW_TOKENS, kv)
        gpu = PagedDecoder(cfg, weights, device="cuda", block_size=BLOCK_SIZE, layout=layout).generate(
            batch, NEW_TOKENS, kv, check_syncs=True)
        for config, c, g in zip(kv, cpu, gpu):
            assert g["tokens"] == c["tokens"], config
            assert g["blocks"] == c["blocks"], config
            if c["kept_positions"] is not None:
                for gp, cp in zip(g["kept_positions"], c["kept_positions"]):
                    assert torch.equal(gp.cpu().sort(-1).values, cp.sort(-1).values), config


def test_serving_benchmark_smoke(tmp_path, monkeypatch):
    """benchmarks/harness_serving.py at toy sizes (what it runs at full size on a GPU):
    every setting decodes every request, and at the same KV memory the
    compressed settings run more requests at once than the uncompressed one."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("harness_serving", bench / "harness_serving.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "harness_serving", module)
    spec.loader.exec_module(module)
    result = module.main(["--smoke", "--device", "cpu", "--out", str(tmp_path / "serving.md")])
    rows = result["rows"]
    assert set(rows) == {"none", "snapkv-span", "h2o"}
    assert all(r["new_tokens"] == r["requests"] * module.SMOKE["new_tokens"] for r in rows.values())
    assert rows["none"]["most_running"] == module.SMOKE["concurrent"]
    assert rows["snapkv-span"]["most_running"] > rows["none"]["most_running"]
    assert rows["h2o"]["most_running"] > rows["none"]["most_running"]
    assert "| snapkv-span |" in (tmp_path / "serving.md").read_text()
