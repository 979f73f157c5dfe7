"""End-to-end check of the CUDA path (FLASH_ATTN cache, Triton ops), run by gpu_check.sh.

On the tiny random Llama in float16, one engine serving every request's policy
through extra_args:
  1. a budget no request reaches gives vanilla vLLM's tokens exactly;
  2. compressed requests (snapkv, h2o, streamingllm) run, evict tokens and
     free blocks, and their greedy tokens are compared with the plain-torch
     reference decoder (float32, on CPU); FLASH_ATTN runs fp16, whose
     rounding differs, so this reports the common prefix instead of asserting
     equality;
  3. an engine with one KV cache group per layer (per-layer budgets, MiniCache,
     each group with its own FLASH_ATTN metadata) under piecewise CUDA graphs
     gives the same tokens as the same engine with --enforce-eager.
Exit status 1 if (1) or (3) fails or nothing was evicted.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def main() -> int:
    from vllm import LLM, SamplingParams

    import vllm_kvcompress
    from kvc_tools.models import build_tiny_llama
    from kvc_tools.reference_decoder import ReferenceDecoder
    from vllm_kvcompress.config import KVCompressConfig

    model = build_tiny_llama(os.path.join(tempfile.mkdtemp(), "tiny"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in (300, 170, 520, 90)]
    new = 48
    llm = LLM(model=str(model), dtype="float16", block_size=16, max_model_len=1024, seed=0,
              gpu_memory_utilization=0.3, kv_compress="none")
    print("kv_compress stats at start:", vllm_kvcompress.stats(llm)["free_blocks"], "free blocks")

    def generate(llm, configs):
        params = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True,
                                 extra_args=None if c is None else {"kv_compress": c}) for c in configs]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    plain = generate(llm, [None] * len(prompts))
    roomy = generate(llm, [{"policy": "snapkv", "budget": len(p) + 1} for p in prompts])
    same = plain == roomy
    print(f"budget above need == vanilla: {same}")
    configs = [{"policy": "snapkv", "budget": 64}, {"policy": "h2o", "budget": 64},
               {"policy": "streamingllm", "budget": 48, "prompt_chunk": 64}, None]
    got = generate(llm, configs)
    stats = vllm_kvcompress.stats(llm)
    ref = ReferenceDecoder(str(model))
    report = []
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        want = ref.generate(prompt, new, cfg, block_size=16)["tokens"]
        prefix = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), len(want))
        report.append({"config": config, "prompt": len(prompt), "common_prefix_with_reference": prefix})
    print(json.dumps({"vanilla_equal": same, "tokens_evicted": stats["tokens_evicted"],
                      "blocks_freed": stats["blocks_freed"], "requests": report}, indent=1))
    del llm
    grouped = [{"policy": "pyramidkv", "budget": 64}, {"policy": "h2o", "budget": 64},
               {"policy": "minicache", "start_layer": 2}, None]
    runs = {}
    for eager in (False, True):
        llm = LLM(model=str(model), dtype="float16", block_size=16, max_model_len=1024, seed=0,
                  gpu_memory_utilization=0.3, kv_compress="none", kv_compress_layer_groups=4, enforce_eager=eager)
        runs[eager] = generate(llm, grouped)
        del llm
        torch.cuda.empty_cache()
    graphs_equal = runs[False] == runs[True]
    print(f"per-layer groups, piecewise CUDA graphs == enforce_eager: {graphs_equal}")
    return 0 if same and graphs_equal and stats["tokens_evicted"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
