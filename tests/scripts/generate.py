"""Greedy generation in a fresh process, printing JSON: the route a user without
`import vllm_kvcompress` takes. Usage: generate.py MODEL PROMPTS_JSON ENGINE_KWARGS_JSON

The engine core may run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
what is checked here is which plugins this process loads; a spawned core
loading the plugin through the entry point is what every server test runs."""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model, prompts, kwargs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=1024,
              seed=0, **kwargs)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = None
    if "kv_compress" in kwargs.get("additional_config", {}):
        client = llm.llm_engine.engine_core
        # The utility call of a spawned core, or the in-process core's method.
        stats = (client.call_utility("kv_compress_stats") if hasattr(client, "call_utility")
                 else client.engine_core.kv_compress_stats())
    print("RESULT " + json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "stats": stats,
        "imported_plugin": "vllm_kvcompress" in sys.modules,
        # seam rows installed in this process (the engine core runs here)
        "installed": (len(sys.modules["vllm_kvcompress.vllm_seam.patches"]._installed)
                      if "vllm_kvcompress.vllm_seam.patches" in sys.modules else None),
    }))
