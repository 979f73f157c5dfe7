"""KVzip's scores against kvpress's own KVzipPress, on the same model and prompt.

The plugin's reference decoder (kvc_tools/reference_decoder.py, the oracle the
engine's tests compare with) computes each prompt token's KVzip score from its
repeat passes; kvpress's `KVzipPress` computes `score_val` in its own code
(transformers' forward with its hooks). This runs both on one prompt and
compares the scores per layer and KV head, the first `sink_tokens` left out
(kvpress overwrites their 1.0 with the first chunk's scores where the context
starts at 0; the plugin keeps them whatever their score). kvpress's context
starts after the chat template's prefix; here it is set to start at 0, as the
plugin repeats the whole prompt.

    bash scripts/kvpress_venv.sh      # kvpress 0.5.5 in .cache/kvpress-venv
    python benchmarks/kvzip_kvpress_check.py                      # the tiny test Llama, 300 tokens, one chunk
    python benchmarks/kvzip_kvpress_check.py --length 600 --chunk-size 256   # three chunks
    python benchmarks/kvzip_kvpress_check.py --model smollm2 --length 1024

Prints the largest absolute difference, the largest relative to the layer's
highest score, and how many of each head's top quarter both keep.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KVPRESS_PYTHON = ROOT / ".cache" / "kvpress-venv" / "bin" / "python"


def kvpress_side(inp: str, out: str) -> None:
    """In the kvpress venv: kvpress's score_val for the prompt, [L, Hkv, T]."""
    import functools

    import torch
    from kvpress import KVzipPress
    from transformers import AutoModelForCausalLM, DynamicCache

    job = json.loads(Path(inp).read_text())
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    press = KVzipPress(compression_ratio=0.5, n_sink=job["sink_tokens"], chunk_size=job["chunk_size"])
    captured = {}

    def capture(_model) -> None:  # instead of compress_post: the scores are what is compared
        captured["scores"] = press.score_val[:, 0].clone()

    press.compress_post = capture
    press.prepare = functools.partial(KVzipPress.prepare, press, prev_postfix_size=job["overlap"])
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([job["tokens"]]), past_key_values=DynamicCache(config=model.config))
        press.prefix_length = 0  # the whole prompt is the context, as the plugin repeats it
    Path(out).write_text(json.dumps(captured["scores"].tolist()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (the tests' Llama), smollm2, or a folder")
    ap.add_argument("--length", type=int, default=300)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--overlap", type=int, default=8)
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--kvpress", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kvpress:
        kvpress_side(*args.kvpress)
        return
    sys.path.insert(0, str(ROOT))
    import random

    import torch
    from transformers import AutoTokenizer

    from kvc_tools.models import build_tiny_llama, default_cache_root, default_smollm2_dir
    from kvc_tools.reference_decoder import ReferenceDecoder
    from vllm_kvcompress.cache_layout import CacheDType
    from vllm_kvcompress.scorers.kvzip import KVzip, RepeatTokens

    model = {"tiny": lambda: build_tiny_llama(default_cache_root() / "models" / "tiny-llama-seed0", seed=0),
             "smollm2": default_smollm2_dir}.get(args.model, lambda: Path(args.model))()
    rng = random.Random(0)
    tokens = [rng.randrange(10, 2000) for _ in range(args.length)]
    scorer = KVzip(sink_tokens=args.sink_tokens, chunk_size=args.chunk_size, overlap=args.overlap)
    reference = ReferenceDecoder(str(model))
    cache = reference._empty_cache()
    reference._forward(tokens, torch.arange(len(tokens)), cache, None, CacheDType("auto"))
    ours = torch.stack(reference._repeat_scores(tokens, cache, scorer,  # type: ignore[misc]
                                                RepeatTokens.of(AutoTokenizer.from_pretrained(str(model))), None,
                                                CacheDType("auto")))
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.json", Path(tmp) / "out.json"
        inp.write_text(json.dumps({"model": str(model), "tokens": tokens, "chunk_size": args.chunk_size,
                                   "overlap": args.overlap, "sink_tokens": args.sink_tokens}))
        subprocess.run([str(KVPRESS_PYTHON), __file__, "--kvpress", str(inp), str(out)], check=True)
        theirs = torch.tensor(json.loads(out.read_text()), dtype=torch.float32)
    s = args.sink_tokens
    ours, theirs = ours[..., s:], theirs[..., s:]
    diff = (ours - theirs).abs()
    relative = (diff.amax(dim=(1, 2)) / theirs.amax(dim=(1, 2))).max()
    k = max(1, ours.shape[-1] // 4)
    top_ours, top_theirs = ours.topk(k, dim=-1).indices, theirs.topk(k, dim=-1).indices
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in
                  zip(top_ours.flatten(0, 1), top_theirs.flatten(0, 1))) / (k * top_ours.shape[0] * top_ours.shape[1])
    print(f"{args.model}, {args.length} tokens, chunks of {args.chunk_size}: scores [L, Hkv, T] {tuple(ours.shape)}, "
          f"largest difference {float(diff.max()):.2e} ({float(relative):.2e} of the layer's highest), top quarter "
          f"shared {overlap:.3f}")


if __name__ == "__main__":
    main()
