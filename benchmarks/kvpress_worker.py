"""kvpress side of ``benchmarks/kvpress_compare.py``: runs in the kvpress venv.

Imports only kvpress, transformers and torch (plus the standard library), so it
runs in ``.cache/kvpress-venv`` (``scripts/kvpress_venv.sh``): kvpress 0.5.5
needs transformers < 5.3, vLLM 0.32 needs >= 5.16.

    python benchmarks/kvpress_worker.py --describe           # versions + press defaults (JSON on stdout)
    python benchmarks/kvpress_worker.py IN.json OUT.json     # generate

IN.json: ``{"model": DIR, "dtype": "float32", "threads": N | null, "requests": [
{"id": "...", "prompt_token_ids": [...], "max_new_tokens": 32, "stop": ["\\n\\n"],
"press": null | {"class": "SnapKVPress", "kwargs": {...}}}]}``; a press's kwargs
may hold another press spec (``ChunkKVPress(press=SnapKVPress(...))``).

Protocol (kvpress's ``KVPressTextGenerationPipeline._forward`` and
``generate_answer``, with the whole prompt as the context and no question):

- prefill the whole prompt once inside ``with press(model):``: every attention
  layer computes its output with the full KV, then the press's forward hook
  compresses that layer's cache (``BasePress.forward_hook``); the first token
  is the argmax of the prefill logits;
- greedy decoding on the compressed cache with the original positions
  (``position_ids = prompt_len + i``, as the pipeline does: no key re-rotation),
  no compression while decoding;
- stop at EOS, at ``max_new_tokens``, or when the text holds a stop string (the
  text is cut before it, as vLLM's ``stop`` does).

The pipeline itself is not used: it appends ``question + "\\n"`` (or a chat
template) after the context, while the plugin is fed the raw completion prompt;
doing its two steps here keeps the token ids identical on both sides.
``ObservedAttentionPress`` needs the attention weights (eager attention), and
``ChunkKVPress`` refuses them, so the model is loaded once per attention
implementation a request needs (``sdpa`` unless the press is observed-attention).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import time

EAGER_PRESSES = {"ObservedAttentionPress"}


def describe() -> dict:
    import kvpress
    import torch
    import transformers

    def defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    return dict(
        kvpress=getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
        transformers=transformers.__version__, torch=torch.__version__, python=platform.python_version(),
        defaults={name: defaults(getattr(kvpress, name)) for name in (
            "SnapKVPress", "StreamingLLMPress", "TOVAPress", "ObservedAttentionPress", "ChunkKVPress")},
    )


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def build_press(spec: dict | None):
    """{"class": "ChunkKVPress", "kwargs": {"press": {"class": "SnapKVPress", ...}, ...}} -> press object."""
    if spec is None:
        return None
    import kvpress

    kwargs = {k: (build_press(v) if isinstance(v, dict) and "class" in v else v)
              for k, v in (spec.get("kwargs") or {}).items()}
    return getattr(kvpress, spec["class"])(**kwargs)


def needs_eager(spec: dict | None) -> bool:
    while spec is not None:
        if spec["class"] in EAGER_PRESSES:
            return True
        spec = (spec.get("kwargs") or {}).get("press")
    return False


def generate(model, tokenizer, prompt_ids: list[int], press, max_new_tokens: int, stop: list[str]) -> dict:
    import torch
    from transformers import DynamicCache

    device = model.device
    ids = torch.tensor([prompt_ids], device=device)
    context_length = ids.shape[1]
    cache = DynamicCache()
    t0 = time.perf_counter()
    with torch.inference_mode():
        with press(model) if press is not None else contextlib.nullcontext():
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        kv_len = [cache.get_seq_length(i) for i in range(len(cache))]
        prefill_s = time.perf_counter() - t0
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        generated = [int(out.logits[0, -1].argmax())]
        text, stopped = _cut(tokenizer.decode(generated, skip_special_tokens=True), stop)
        position = context_length
        while not stopped and generated[-1] not in eos and len(generated) < max_new_tokens:
            out = model(input_ids=torch.tensor([[generated[-1]]], device=device), past_key_values=cache,
                        position_ids=torch.tensor([[position]], device=device))
            position += 1
            generated.append(int(out.logits[0, -1].argmax()))
            text, stopped = _cut(tokenizer.decode(generated, skip_special_tokens=True), stop)
    finish = "stop" if stopped or generated[-1] in eos else "length"
    return dict(text=text, token_ids=generated, finish_reason=finish, prompt_tokens=context_length,
                kv_tokens_after_prefill=kv_len[0] if len(set(kv_len)) == 1 else kv_len,
                prefill_s=round(prefill_s, 3), total_s=round(time.perf_counter() - t0, 3))


def _cut(text: str, stop: list[str]) -> tuple[str, bool]:
    hits = [text.index(s) for s in stop if s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def run(inp: dict, out_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if inp.get("threads"):
        torch.set_num_threads(int(inp["threads"]))
    dtype = getattr(torch, inp.get("dtype", "float32"))
    tokenizer = AutoTokenizer.from_pretrained(inp["model"])
    models: dict[str, object] = {}

    def model_for(attn: str):
        if attn not in models:
            m = AutoModelForCausalLM.from_pretrained(inp["model"], dtype=dtype, attn_implementation=attn)
            m.eval()
            models[attn] = m
        return models[attn]

    reqs = inp["requests"]
    results: dict[str, dict] = {}
    t_start = time.perf_counter()
    last_flush = t_start
    for i, r in enumerate(reqs):
        attn = "eager" if needs_eager(r.get("press")) else "sdpa"
        res = generate(model_for(attn), tokenizer, r["prompt_token_ids"], build_press(r.get("press")),
                       r["max_new_tokens"], r.get("stop") or [])
        res["attn_implementation"] = attn
        results[r["id"]] = res
        done = i + 1
        el = time.perf_counter() - t_start
        print(f"[kvpress] {done}/{len(reqs)} {r['id']}: {res['prompt_tokens']} -> {res['kv_tokens_after_prefill']} "
              f"KV, {len(res['token_ids'])} tok, {res['total_s']:.1f} s (elapsed {el:.0f} s, "
              f"eta {el / done * (len(reqs) - done):.0f} s)", file=sys.stderr, flush=True)
        if time.perf_counter() - last_flush > 60 or done == len(reqs):
            _write(out_path, inp, results, time.perf_counter() - t_start, done == len(reqs))
            last_flush = time.perf_counter()
    if not reqs:
        _write(out_path, inp, results, 0.0, True)


def _write(path: str, inp: dict, results: dict, wall_s: float, complete: bool) -> None:
    import torch

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(dict(info=describe(), threads=torch.get_num_threads(), wall_s=wall_s, complete=complete,
                       model=inp["model"], results=results), f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?")
    p.add_argument("output", nargs="?")
    p.add_argument("--describe", action="store_true", help="print versions and press defaults as JSON")
    args = p.parse_args(argv)
    if args.describe:
        print(json.dumps(describe()))
        return 0
    if not (args.input and args.output):
        p.error("IN.json and OUT.json are required (or --describe)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with open(args.input) as f:
        inp = json.load(f)
    run(inp, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
