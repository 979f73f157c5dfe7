"""Micro-benchmark of the KV-compression kernels.

On CUDA: times each Triton kernel and its torch reference (CUDA events, warmup, median)
and compares with the memory-bound floor = (bytes the op must read + write) / peak
bandwidth (``--bandwidth``, default H200 HBM3e 4.8e12 B/s). On CPU (no CUDA) only the
torch references are timed (wall clock), and the table says so.

``fused`` times decode attention that also adds its probabilities to the score buffer
(``decode_attention_with_scores``) in three rows: ``fused`` (attention + scores, one pass
over K and V), ``fused_attn`` (the same op with ``scores_out=None``: attention alone;
on CUDA also torch SDPA over dense copies of the same K/V and vLLM's paged flash-attn
when importable) and ``fused_separate`` (attention alone, then ``accumulate_decode_scores``:
the second pass over K the fused op saves). The ratios fused / attention alone follow
the table (issue 17 target: at most 1.15x on CUDA).

    python benchmarks/kernels.py                     # 32 req x 4k tokens, 8 kv heads, G=4, D=128, bs 16, bf16
    python benchmarks/kernels.py --num-reqs 4 --seq-len 1024 --ops decode,compact

Prints a Markdown table (and writes it to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

try:
    from vllm_kvcompress import kernels as K
except Exception:  # running from a checkout before the package mapping exists
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kernels as K  # type: ignore[no-redef]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --ops names that stand for several rows
OP_GROUPS = {"fused": ("fused", "fused_attn", "fused_separate")}
FUSED_TARGET = 1.15  # issue 17: fused attention + scores at most this times attention alone


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-reqs", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="GQA group size G (num_q_heads = G * kv heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--window", type=int, default=32, help="observation window (SnapKV) queries per request")
    p.add_argument("--keep", type=float, default=0.25, help="fraction of tokens kept by compaction")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="peak memory bandwidth, B/s (H200: 4.8e12)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ops", default="window,decode,decode_gumbel,decode_lse,fused,compact")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--no-torch", action="store_true", help="skip the torch references on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------


def time_fn(fn: Callable[[], object], device: str, warmup: int, iters: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_inputs(a, device: str):
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    dt = DTYPES[a.dtype]
    R, T, H, G, D, bs = a.num_reqs, a.seq_len, a.num_kv_heads, a.group, a.head_dim, a.block_size
    nb = -(-T // bs)
    nblocks = R * nb
    bt = torch.randperm(nblocks, generator=g).reshape(R, nb).to(torch.int32)
    kv = torch.randn(nblocks, H, bs, 2 * D, generator=g).to(dt)  # vLLM 0.32's cache tensor
    kv, bt = kv.to(device), bt.to(device)
    key_cache, value_cache = K.torch_ops.split_kv_cache(kv)
    W = min(a.window, T)
    inp = dict(
        kv=kv, key_cache=key_cache, value_cache=value_cache, bt=bt,
        seq_lens=torch.full((R,), T, dtype=torch.int32, device=device),
        q_win=torch.randn(R * W, H * G, D, generator=g).to(dt).to(device),
        cu_q=(torch.arange(R + 1, dtype=torch.int32) * W).to(device),
        q_pos=torch.arange(T - W, T, dtype=torch.int32).repeat(R).to(device),
        q_dec=torch.randn(R, H * G, D, generator=g).to(dt).to(device),
        scores=torch.zeros(R, H * G, T, device=device),
        # what compaction permutes: one tensor, cloned for each implementation
        compact_scores=torch.rand(R, H * G, T, generator=g).to(device),
        noise=(-torch.log(-torch.log(torch.rand(R, H * G, T, generator=g).clamp(1e-6, 1 - 1e-6)))).to(device),
        W=W,
    )
    keep = max(1, int(T * a.keep))
    # sinks + random middle + recent (ascending, idx[j] >= j), different per head
    idx = torch.stack([
        torch.stack([torch.randperm(T, generator=g)[:keep].sort().values for _ in range(H)]) for _ in range(R)
    ]).to(torch.int32)
    inp.update(keep_idx=idx.to(device), keep=keep)
    return inp


def floor_bytes(op: str, a, inp) -> int:
    """Bytes the op must move at least (each input read once, each output written once)."""
    elt = DTYPES[a.dtype].itemsize
    R, T, H, G, D = a.num_reqs, a.seq_len, a.num_kv_heads, a.group, a.head_dim
    W, keep = inp["W"], inp["keep"]
    k_bytes = R * H * T * D * elt
    if op == "window":  # K once, window queries, scores read+written (accumulating)
        return k_bytes + R * W * H * G * D * elt + R * H * G * T * 8
    q_bytes = R * H * G * D * elt
    if op.startswith("decode"):  # K once, q, scores read+written (+ noise read, + lse)
        extra = R * H * G * T * 4 if op == "decode_gumbel" else 0
        return k_bytes + q_bytes + R * H * G * T * 8 + extra
    if op == "fused_attn":  # K and V once, q read, out written
        return 2 * k_bytes + 2 * q_bytes
    if op == "fused":  # + scores read and written
        return 2 * k_bytes + 2 * q_bytes + R * H * G * T * 8
    if op == "fused_separate":  # attention alone, then the scoring pass reads K again
        return floor_bytes("fused_attn", a, inp) + floor_bytes("decode", a, inp)
    if op == "compact":  # kept K and V rows read + written, indices, scores permuted + tail zeroed
        return 2 * 2 * R * H * keep * D * elt + R * H * keep * 4 + R * H * G * (keep * 8 + (T - keep) * 4)
    raise ValueError(op)


def make_call(op: str, ops, a, inp, lse: Optional[torch.Tensor]):
    """``(call, result)``: ``result()`` gives the tensors to compare across
    implementations after one ``call()``."""
    scale = a.head_dim**-0.5
    if op == "window":
        out = torch.zeros_like(inp["scores"])
        return lambda: ops.window_scores_batched(
            inp["q_win"], inp["cu_q"], inp["key_cache"], inp["bt"], inp["seq_lens"], inp["q_pos"], scale,
            out=out, max_seq_len=a.seq_len, max_q_len=inp["W"]), lambda: (out,)
    if op.startswith("decode"):
        out = torch.zeros_like(inp["scores"])
        tr = ("gumbel", inp["noise"], 1.0) if op == "decode_gumbel" else None
        lse_arg = lse if op == "decode_lse" else None
        return lambda: ops.accumulate_decode_scores(
            inp["q_dec"], inp["key_cache"], inp["bt"], inp["seq_lens"], out, scale, tr, lse=lse_arg,
            max_seq_len=a.seq_len), lambda: (out,)
    if op.startswith("fused"):
        scores = torch.zeros_like(inp["scores"])
        attn: dict[str, torch.Tensor] = {}
        args = (inp["q_dec"], inp["key_cache"], inp["value_cache"], inp["bt"], inp["seq_lens"], scale)

        def call() -> None:
            if op == "fused":
                attn["out"] = ops.decode_attention_with_scores(*args, scores, max_seq_len=a.seq_len)
                return
            attn["out"] = ops.decode_attention_with_scores(*args, None, max_seq_len=a.seq_len)
            if op == "fused_separate":
                ops.accumulate_decode_scores(inp["q_dec"], inp["key_cache"], inp["bt"], inp["seq_lens"], scores,
                                             scale, max_seq_len=a.seq_len)

        return call, lambda: (attn["out"],) if op == "fused_attn" else (attn["out"], scores)
    if op == "compact":
        # every implementation compacts the same caches and scores (clones of one input)
        kc, vc = inp["key_cache"].clone(), inp["value_cache"].clone()
        sc = inp["compact_scores"].clone()
        return lambda: ops.compact_kv_batched(kc, vc, inp["bt"], inp["keep_idx"], None, sc), lambda: (kc, vc, sc)
    raise ValueError(op)


def attention_baselines(a, inp) -> tuple[list[tuple[str, Callable[[], torch.Tensor]]], list[str]]:
    """Decode attention by other kernels over the same K/V (CUDA only): torch SDPA over
    dense copies (made once, not timed) and vLLM's paged flash-attn when importable.
    Returns ``[(name, call returning out [R, Hq, D])]`` and notes on what was skipped."""
    R, T = a.num_reqs, a.seq_len
    scale = a.head_dim**-0.5
    q = inp["q_dec"]
    dense = [torch.stack([K.torch_ops.gather_dense(c, inp["bt"][r], T) for r in range(R)])
             for c in (inp["key_cache"], inp["value_cache"])]  # [R, Hkv, T, D] each

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q[:, :, None], dense[0], dense[1], scale=scale, enable_gqa=True)
        return out[:, :, 0]

    calls: list[tuple[str, Callable[[], torch.Tensor]]] = [("sdpa (dense)", sdpa)]
    notes = []
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        cu_q = torch.arange(R + 1, dtype=torch.int32, device=q.device)
        fa_out = torch.empty_like(q)

        def flash() -> torch.Tensor:
            flash_attn_varlen_func(q=q, k=inp["key_cache"], v=inp["value_cache"], max_seqlen_q=1, cu_seqlens_q=cu_q,
                                   max_seqlen_k=T, seqused_k=inp["seq_lens"], softmax_scale=scale, causal=True,
                                   block_table=inp["bt"], out=fa_out)
            return fa_out

        flash()  # fails here, not in the timing loop, if this build cannot run it
        calls.append(("flash-attn (vLLM, paged)", flash))
    except Exception as e:  # not installed, no CUDA extension, or an unsupported shape
        notes.append(f"vLLM flash-attn skipped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return calls, notes


def decode_lse(inp, a) -> torch.Tensor:
    """LSE of the decode logits, as flash-attn's softmax_lse would provide it."""
    R, H, G, D = a.num_reqs, a.num_kv_heads, a.group, a.head_dim
    out = torch.empty(R, H * G, device=inp["q_dec"].device)
    for r in range(R):
        kd = K.torch_ops.gather_dense(inp["key_cache"], inp["bt"][r], a.seq_len).float()
        x = torch.matmul(inp["q_dec"][r].float().reshape(H, G, D), kd.transpose(-1, -2)) * D**-0.5
        out[r] = torch.logsumexp(x, -1).reshape(-1)
    return out


def max_diff(x, y) -> float:
    """Largest absolute difference over the tensors both results share (a baseline
    returns the attention output alone)."""
    return max(float((u.float() - v.float()).abs().max()) for u, v in zip(x, y))


def main(argv=None) -> str:
    a = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    torch_ops = K.get_ops("cpu")  # torch references, on whatever device the tensors live
    triton_ops = K.get_ops("cuda") if device == "cuda" else None
    if triton_ops is not None and triton_ops.backend != "triton":
        triton_ops = None
    inp = build_inputs(a, device)
    lse = decode_lse(inp, a)
    rows: list[tuple] = []  # (op, impl, seconds, floor seconds, floor bytes[, max abs diff])
    notes: list[str] = []
    names = [o.strip() for o in a.ops.split(",") if o.strip()]
    for op in [sub for o in names for sub in OP_GROUPS.get(o, (o,))]:
        fb = floor_bytes(op, a, inp)
        floor_s = fb / a.bandwidth
        results = {}
        impls = []
        if triton_ops is not None:
            impls.append(("triton", triton_ops))
        if triton_ops is None or not a.no_torch:
            impls.append(("torch", torch_ops))
        for name, ops in impls:
            call, res = make_call(op, ops, a, inp, lse)
            call()  # one clean call for the correctness comparison
            results[name] = tuple(t.clone() for t in res())
            t = time_fn(call, device, a.warmup, a.iters)
            rows.append((op, name, t, floor_s, fb))
        if op == "fused_attn" and device == "cuda":
            baselines, skipped = attention_baselines(a, inp)
            notes += skipped
            for name, fn in baselines:
                results[name] = (fn().clone(),)
                rows.append((op, name, time_fn(fn, device, a.warmup, a.iters), floor_s, fb))
        if "torch" in results:
            diffs = {name: max_diff(res, results["torch"]) for name, res in results.items() if name != "torch"}
            rows = [r + (diffs[r[1]],) if r[0] == op and r[1] in diffs else r for r in rows]
    head = (f"Kernels on {device}"
            + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else
               " - no CUDA: only the torch references are timed (wall clock)")
            + f": {a.num_reqs} req x {a.seq_len} tok, {a.num_kv_heads} kv heads, G={a.group}, "
              f"D={a.head_dim}, block {a.block_size}, {a.dtype}, window {inp['W']}, keep {inp['keep']}; "
              f"floor at {a.bandwidth / 1e12:.2f} TB/s; median of {a.iters}")
    lines = [head, "",
             "| op | impl | time (us) | floor (us) | x floor | achieved (GB/s) | max abs diff vs torch |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        op, name, t, floor_s, fb = row[:5]
        diff = f"{row[5]:.2e}" if len(row) > 5 else ""
        lines.append(f"| {op} | {name} | {t * 1e6:.1f} | {floor_s * 1e6:.1f} | {t / floor_s:.2f} | "
                     f"{fb / t / 1e9:.1f} | {diff} |")
    lines += fused_summary(rows, device) + [f"- {n}" for n in notes]
    text = "\n".join(lines)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return text


def fused_summary(rows, device: str) -> list[str]:
    """Lines comparing each implementation's fused op with its attention alone (and with
    the separate scoring pass), when the table has those rows."""
    times = {(op, name): t for op, name, t, *_ in rows}
    lines = []
    for name in ("triton", "torch"):
        attn = times.get(("fused_attn", name))
        if attn is None or ("fused", name) not in times:
            continue
        ratio = times["fused", name] / attn
        line = f"- {name}: fused / attention alone = {ratio:.2f}x"
        if name == "triton" and device == "cuda":
            line += f" (target <= {FUSED_TARGET:.2f}x: {'met' if ratio <= FUSED_TARGET else 'NOT met'})"
        if ("fused_separate", name) in times:
            line += f"; separate pass / attention alone = {times['fused_separate', name] / attn:.2f}x"
        lines.append(line)
    return [""] + lines if lines else []


if __name__ == "__main__":
    main()
