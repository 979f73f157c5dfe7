"""Offline batch generation with KV-cache compression on SmolLM2-135M-Instruct.

    python examples/offline_generate.py [--policy snapkv-span] [--budget 256] [--selection span] [--span 16]

Runs the same needle-in-a-haystack prompts (about 2k tokens each) once without
and once with compression, in two engines, and prints the answers and what the
compression did (tokens evicted, blocks freed and held per request).
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The recommended policy: SnapKV scores, span carry 16, 4 sink tokens.
    parser.add_argument("--policy", default="snapkv-span")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--selection", help="top | span | chunk (default: the policy's; span: keep what follows "
                                            "a kept token)")
    parser.add_argument("--span", type=int, help="span carry length (default: the policy's)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    import vllm_kvcompress
    from kvc_tools.longctx import generate_samples
    from kvc_tools.models import prepare_smollm2

    model = str(prepare_smollm2())
    samples = generate_samples("niah_single", args.length, args.requests)
    params = SamplingParams(max_tokens=24, temperature=0)
    common = dict(model=model, dtype="float32", enforce_eager=True, block_size=32,
                  max_model_len=args.length + 256)
    prompts = [s["input"] for s in samples]

    answers = {}
    compressed = dict(kv_compress=args.policy, kv_compress_budget=args.budget)
    if args.selection is not None:
        compressed["kv_compress_selection"] = args.selection
    if args.span is not None:
        compressed["kv_compress_span"] = args.span
    for name, extra in (("full KV", {}), (f"{args.policy} {args.budget}", compressed)):
        llm = LLM(**common, **extra)
        outs = llm.generate(prompts, params, use_tqdm=False)
        answers[name] = [o.outputs[0].text.strip() for o in outs]
        stats = vllm_kvcompress.stats(llm)
        llm.llm_engine.engine_core.shutdown()
        del llm
    print("\n=== answers (expected | full KV | compressed)")
    for s, full, small in zip(samples, *answers.values()):
        print(f"{s['outputs'][0]!r:>12} | {full[:40]!r} | {small[:40]!r}")
    print(f"\n=== what {args.policy} did: budget {args.budget} tokens per layer and KV head")
    for rid, r in stats["requests"].items():
        print(f"request {rid}: prompt {r['prefill_len']} tokens -> kept {r['tokens_kept']}, "
              f"evicted {r['tokens_evicted']}, freed {r['blocks_freed']} blocks, "
              f"held {r['blocks_held']} blocks at the end")
    print(f"total: {stats['tokens_evicted']} tokens evicted, {stats['blocks_freed']} blocks "
          f"returned to vLLM's pool mid-request")


if __name__ == "__main__":
    main()
