"""Kernel tests.

1. The torch references (``vllm_kvcompress.kernels.torch_ops``) against brute-force naive
   implementations (Python loops, explicit softmax in float64) on small inputs.
2. The Triton kernels against the references on random paged caches: GQA group sizes
   1/3/8, head_dim 64/128, block sizes 16/32/128, ragged lengths (1, not multiples of the
   block size), shuffled block tables with stale padding entries, fp32/fp16/bf16.
   Without a GPU, Triton runs under TRITON_INTERPRET=1 (set in tests/conftest.py), so sizes are
   kept small and configurations are chosen to cover each value, not the cross product.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_kvcompress.kernels import OP_NAMES, get_ops, torch_paged
from vllm_kvcompress.kernels import torch_ops as ref
from vllm_kvcompress.selection import hole_filling_order

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
RUN_TRITON = HAVE_TRITON and (DEVICE == "cuda" or INTERPRET)
needs_triton = pytest.mark.skipif(not RUN_TRITON, reason="needs triton (GPU or TRITON_INTERPRET=1)")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Scores are fp32 sums of probabilities that both sides compute in fp32 from the same
# stored (up-cast) values, so only summation order and exp/log approximations differ:
# the input dtype barely matters. Slightly looser for fp16/bf16 (on GPU the kernel's
# tl.dot runs on tensor cores with its own accumulation order).
TOL = {F32: dict(atol=2e-5, rtol=1e-4), F16: dict(atol=5e-5, rtol=3e-4), BF16: dict(atol=5e-5, rtol=3e-4)}


def tk():
    from vllm_kvcompress.kernels import triton_kernels

    return triton_kernels


# ---------------------------------------------------------------------------------------
# random paged inputs
# ---------------------------------------------------------------------------------------


def make_paged(gen, lens, hkv, d, bs, dtype, spare_blocks=3, kv_layout=None):
    """Caches with shuffled, non-contiguous block tables (+ stale padding entries) and
    some blocks owned by nobody. Returns key_cache, value_cache, block_tables."""
    need = [max(1, -(-L // bs)) for L in lens]
    nblocks = sum(need) + spare_blocks
    perm = torch.randperm(nblocks, generator=gen)
    max_nb = max(need) + 1
    bt = torch.empty(len(lens), max_nb, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        bt[r, :n] = perm[used : used + n]
        used += n
        bt[r, n:] = perm[torch.randint(0, nblocks, (max_nb - n,), generator=gen)]  # stale ids
    if kv_layout == "HND":  # one vLLM 0.32 cache tensor [N, H, B, 2D]: K, V halves of the last dim
        kv = torch.randn((nblocks, hkv, bs, 2 * d), generator=gen).to(dtype).to(DEVICE)
        k, v = ref.split_kv_cache(kv)
    elif kv_layout == "NHD":  # the same logical shape, stored [N, B, H, 2D]
        kv = torch.randn((nblocks, bs, hkv, 2 * d), generator=gen).to(dtype).to(DEVICE)
        k, v = ref.split_kv_cache(kv.transpose(1, 2))
    else:
        shape = (nblocks, bs, hkv, d)
        k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return k, v, bt.to(DEVICE)


def naive_dense(cache, bt_row, L):
    bs = cache.shape[1]
    rows = [cache[int(bt_row[p // bs]), p % bs] for p in range(L)]  # [H, D] each
    return torch.stack(rows, dim=1) if rows else cache.new_zeros(cache.shape[2], 0, cache.shape[3])


def softmax64(x):
    x = x.double()
    e = torch.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------------------------------
# 1. references vs brute force
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [16, 32])
def test_gather_dense_matches_naive(bs):
    gen = torch.Generator().manual_seed(bs)
    lens = [1, bs, 2 * bs + 3]
    k, _, bt = make_paged(gen, lens, 2, 16, bs, F32)
    for r, L in enumerate(lens):
        got = ref.gather_dense(k, bt[r], L)
        assert got.shape == (2, L, 16)
        assert torch.equal(got, naive_dense(k, bt[r], L))


def naive_window(q_win, kd, qpos, scale, g):
    hq = q_win.shape[1]
    out = torch.zeros(hq, kd.shape[1], dtype=torch.float64)
    for i in range(q_win.shape[0]):
        p_i = int(qpos[i])
        for h in range(hq):
            logits = [float(q_win[i, h].double() @ kd[h // g, j].double()) * scale for j in range(p_i + 1)]
            out[h, : p_i + 1] += softmax64(torch.tensor(logits))
    return out


@pytest.mark.parametrize("g,dtype", [(1, F32), (3, BF16), (2, F16)])
def test_reference_window_scores_vs_naive(g, dtype):
    gen = torch.Generator().manual_seed(10 + g)
    hkv, d, bs, L, w = 2, 16, 8, 21, 5
    k, _, bt = make_paged(gen, [L], hkv, d, bs, dtype)
    q = torch.randn(w, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    qpos = torch.tensor([3, 10, 18, 19, 20])  # arbitrary ascending physical positions
    scale = d**-0.5
    got = ref.window_scores(q, k, bt[0], L, qpos.to(DEVICE), scale)
    want = naive_window(q.cpu(), naive_dense(k, bt[0], L).cpu(), qpos, scale, g)
    assert got.dtype == torch.float32 and got.shape == (hkv * g, L)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)
    # each query contributes probability mass 1 per head
    torch.testing.assert_close(got.sum(-1).cpu(), torch.full((hkv * g,), float(w)), atol=1e-4, rtol=0)


def test_reference_window_batched_adds_and_pads():
    gen = torch.Generator().manual_seed(3)
    lens, ws = [9, 1, 30], [4, 1, 7]
    hkv, g, d, bs = 2, 2, 16, 8
    k, _, bt = make_paged(gen, lens, hkv, d, bs, F32)
    cu = torch.tensor([0, 4, 5, 12], device=DEVICE)
    q = torch.randn(12, hkv * g, d, generator=gen).to(DEVICE)
    qpos = torch.cat([torch.arange(L - w, L) for L, w in zip(lens, ws)]).to(DEVICE)
    out0 = torch.rand(3, hkv * g, 32, generator=gen).to(DEVICE)
    out = ref.window_scores_batched(q, cu, k, bt, torch.tensor(lens, device=DEVICE), qpos, 0.3, out=out0.clone())
    for b, L in enumerate(lens):
        one = ref.window_scores(q[cu[b] : cu[b + 1]], k, bt[b], L, qpos[cu[b] : cu[b + 1]], 0.3)
        torch.testing.assert_close(out[b, :, :L], out0[b, :, :L] + one)
        assert torch.equal(out[b, :, L:], out0[b, :, L:])


def test_reduce_gqa_and_pool_vs_naive():
    gen = torch.Generator().manual_seed(4)
    s = torch.rand(6, 11, generator=gen)
    red_mean = ref.reduce_gqa(s, 3, "mean")
    red_max = ref.reduce_gqa(s, 3, "max")
    for h in range(2):
        torch.testing.assert_close(red_mean[h], s[3 * h : 3 * h + 3].mean(0))
        torch.testing.assert_close(red_max[h], s[3 * h : 3 * h + 3].max(0).values)
    for ksz in (1, 3, 5, 7):
        p = ksz // 2
        avg = ref.pool_scores(s, ksz, "avg")
        mx = ref.pool_scores(s, ksz, "max")
        assert avg.shape == s.shape == mx.shape
        for j in range(s.shape[1]):
            lo, hi = max(0, j - p), min(s.shape[1], j + p + 1)
            torch.testing.assert_close(avg[:, j], s[:, lo:hi].sum(1) / ksz)  # count_include_pad
            torch.testing.assert_close(mx[:, j], s[:, lo:hi].max(1).values)
    # batched leading dims pool each row independently
    sb = torch.rand(2, 4, 9, generator=gen)
    torch.testing.assert_close(ref.pool_scores(sb, 5)[1, 2], ref.pool_scores(sb[1, 2][None], 5)[0])
    with pytest.raises(ValueError):
        ref.reduce_gqa(s, 4)


def gumbel(gen, shape):
    u = torch.rand(shape, generator=gen).clamp_(1e-6, 1 - 1e-6)
    return -torch.log(-torch.log(u))


def naive_decode(q, k, bt, lens, scores, scale, noise=None, tau=None, lse=None):
    out = scores.clone().double().cpu()
    g = q.shape[1] // k.shape[2]
    for r, L in enumerate(lens):
        kd = naive_dense(k, bt[r], L).cpu().double()
        for h in range(q.shape[1]):
            x = torch.stack([q[r, h].cpu().double() @ kd[h // g, j] for j in range(L)]) * scale
            if noise is not None:
                t = float(tau[r]) if torch.is_tensor(tau) else tau
                x = (x + noise[r, h, :L].double().cpu()) / t
            if lse is not None:
                p = torch.exp(x - float(lse[r, h]))
            else:
                p = softmax64(x)
            out[r, h, :L] += p
    return out


@pytest.mark.parametrize("mode", ["plain", "gumbel", "gumbel_tau_vec", "lse"])
def test_reference_decode_vs_naive(mode):
    gen = torch.Generator().manual_seed(5)
    lens = [1, 13, 20]
    hkv, g, d, bs = 2, 3, 16, 8
    k, _, bt = make_paged(gen, lens, hkv, d, bs, BF16)
    q = torch.randn(3, hkv * g, d, generator=gen).to(BF16).to(DEVICE)
    scores = torch.rand(3, hkv * g, 24, generator=gen).to(DEVICE)
    scale = 0.25
    noise = tau = lse = None
    if mode.startswith("gumbel"):
        noise = gumbel(gen, (3, hkv * g, 24)).to(DEVICE)
        tau = 1.7 if mode == "gumbel" else torch.tensor([0.5, 1.0, 2.5], device=DEVICE)
    if mode == "lse":
        lse = torch.empty(3, hkv * g)
        for r, L in enumerate(lens):
            kd = naive_dense(k, bt[r], L).float().cpu()
            x = torch.einsum("hgd,htd->hgt", q[r].float().cpu().reshape(hkv, g, d), kd) * scale
            lse[r] = torch.logsumexp(x, -1).reshape(-1)
        lse = lse.to(DEVICE)
    want = naive_decode(q, k, bt, lens, scores, scale, noise, tau, lse)
    tr = None if noise is None else ("gumbel", noise, tau)
    got = ref.accumulate_decode_scores(q, k, bt, torch.tensor(lens, device=DEVICE), scores, scale, tr, lse=lse)
    assert got is scores  # in place
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)


def naive_decode_attention(q, k, v, bt, lens, scale):
    """Per request: dense gather, float64 softmax, matmul. -> out [R, Hq, D], probs [R, Hq, max_T]."""
    nreq, hq, d = q.shape
    g = hq // k.shape[2]
    out = torch.zeros(nreq, hq, d, dtype=torch.float64)
    probs = torch.zeros(nreq, hq, max(lens), dtype=torch.float64)
    for r, L in enumerate(lens):
        if L == 0:
            continue
        kd, vd = (naive_dense(c, bt[r], L).cpu().double() for c in (k, v))
        for h in range(hq):
            p = softmax64(kd[h // g] @ q[r, h].cpu().double() * scale)
            out[r, h] = p @ vd[h // g]
            probs[r, h, :L] = p
    return out, probs


@pytest.mark.parametrize("g,bs,dtype,with_scores,chunked", [
    pytest.param(1, 8, F32, True, False, id="G1-bs8-fp32-scores"),
    pytest.param(3, 16, BF16, True, True, id="G3-bs16-bf16-scores-chunked"),
    pytest.param(4, 8, F16, False, False, id="G4-bs8-fp16"),
    pytest.param(2, 16, F32, False, True, id="G2-bs16-fp32-chunked"),
])
def test_reference_decode_attention_vs_naive(g, bs, dtype, with_scores, chunked, monkeypatch):
    if chunked:  # one request per chunk: the loop over chunks is exercised
        monkeypatch.setattr(torch_paged, "_CHUNK_ELEMS", 1)  # read by every torch op
    gen = torch.Generator().manual_seed(20 + g)
    lens = [1, 13, 0, 2 * bs + 3]  # length 1, an empty request, not multiples of the block size
    hkv, d, scale = 2, 16, 0.3
    k, v, bt = make_paged(gen, lens, hkv, d, bs, dtype)  # shuffled block tables, stale padding ids
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    scores0 = torch.rand(len(lens), hkv * g, max(lens) + 4, generator=gen).to(DEVICE)
    scores = scores0.clone() if with_scores else None
    out = ref.decode_attention_with_scores(q, k, v, bt, torch.tensor(lens, device=DEVICE), scale, scores)
    want_out, want_p = naive_decode_attention(q, k, v, bt, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=1e-2, rtol=1e-2)  # out rounded to dtype
    torch.testing.assert_close(out.cpu().double(), want_out, **tol)
    if with_scores:
        assert scores is not None
        want = scores0.cpu().double()
        want[:, :, : max(lens)] += want_p
        torch.testing.assert_close(scores.cpu().double(), want, atol=1e-5, rtol=1e-5)  # columns >= seq_len untouched


@pytest.mark.parametrize("g,bs", [(1, 16), (4, 8)])
def test_reference_decode_attention_scores_match_accumulate(g, bs):
    gen = torch.Generator().manual_seed(30 + g)
    lens = [7, 1, 3 * bs - 5]
    k, v, bt = make_paged(gen, lens, 2, 32, bs, BF16)
    q = torch.randn(3, 2 * g, 32, generator=gen).to(BF16).to(DEVICE)
    sl = torch.tensor(lens, device=DEVICE)
    scores0 = torch.rand(3, 2 * g, 50, generator=gen).to(DEVICE)
    fused, separate = scores0.clone(), scores0.clone()
    ref.decode_attention_with_scores(q, k, v, bt, sl, 0.2, fused, max_seq_len=max(lens))
    ref.accumulate_decode_scores(q, k, bt, sl, separate, 0.2, max_seq_len=max(lens))
    torch.testing.assert_close(fused, separate, atol=1e-6, rtol=1e-6)


def test_reference_decode_attention_checks():
    gen = torch.Generator().manual_seed(40)
    k, v, bt = make_paged(gen, [20, 5], 2, 16, 8, F32, spare_blocks=0)  # bt: 3 + 1 columns
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    sl = torch.tensor([20, 5], device=DEVICE)
    scores = torch.zeros(2, 4, 20, device=DEVICE)
    call = ref.decode_attention_with_scores
    with pytest.raises(ValueError, match="scores_out must be float32"):
        call(q, k, v, bt, sl, 1.0, scores.double())
    with pytest.raises(ValueError, match="more than scores_out holds"):
        call(q, k, v, bt, sl, 1.0, scores[..., :19])
    with pytest.raises(ValueError, match=r"scores_out must be \[R=2, Hq=4"):
        call(q, k, v, bt, sl, 1.0, scores[:, :2])
    with pytest.raises(ValueError, match="block_tables has 2"):
        call(q, k, v, bt[:, :2], sl, 1.0, None)
    with pytest.raises(ValueError, match="value_cache"):
        call(q, k, v[:, :4], bt, sl, 1.0, None)
    with pytest.raises(ValueError, match="seq_lens must be"):
        call(q, k, v, bt, sl[:1], 1.0, None)
    with pytest.raises(ValueError, match="does not fit key_cache"):
        call(q[:, :3], k, v, bt, sl, 1.0, None)
    # nothing to attend: zeros, the score buffer untouched
    out = call(q, k, v, bt, torch.zeros_like(sl), 1.0, scores)
    assert not out.any() and not scores.any()


def naive_compact(k, v, bt, keep, counts, scores):
    """Sequential forward copy (safe because keep is ascending, so keep[j] >= j)."""
    k, v = k.clone().cpu(), v.clone().cpu()
    scores = None if scores is None else scores.clone().cpu()
    bs = k.shape[1]
    nreq, hkv, kmax = keep.shape
    for r in range(nreq):
        for h in range(hkv):
            c = kmax if counts is None else int(counts[r, h])
            for j in range(c):
                s = int(keep[r, h, j])
                assert s >= j
                db, do = int(bt[r, j // bs]), j % bs
                sb, so = int(bt[r, s // bs]), s % bs
                k[db, do, h] = k[sb, so, h]
                v[db, do, h] = v[sb, so, h]
                if scores is not None:
                    g = scores.shape[1] // hkv
                    scores[r, h * g : (h + 1) * g, j] = scores[r, h * g : (h + 1) * g, s]
            if scores is not None:
                g = scores.shape[1] // hkv
                scores[r, h * g : (h + 1) * g, c:] = 0
    return k, v, scores


def make_keep(gen, lens, hkv, kmax, pattern, per_head_counts, hole_filling=False):
    """keep_idx [R, Hkv, kmax] ascending (or in the plugin's hole-filling order),
    counts [R, Hkv] (or None). Entries past a head's count are garbage and must be
    ignored."""
    nreq = len(lens)
    keep = torch.randint(0, 7, (nreq, hkv, kmax), generator=gen)  # garbage by default
    counts = torch.empty(nreq, hkv, dtype=torch.long)
    for r, L in enumerate(lens):
        for h in range(hkv):
            c = min(L, kmax)
            if per_head_counts:
                c = int(torch.randint(0, c + 1, (1,), generator=gen))
            if pattern == "random":
                idx = torch.randperm(L, generator=gen)[:c].sort().values
            elif pattern == "prefix_then_jump":  # maximal overlap: identity, then a gap
                a = c // 2
                idx = torch.cat([torch.arange(a), torch.arange(L - (c - a), L)])
            else:  # "sink_recent" (StreamingLLM)
                s = min(4, c)
                idx = torch.cat([torch.arange(s), torch.arange(L - (c - s), L)])
            if hole_filling and c:
                idx = hole_filling_order(idx[None])[0]
            keep[r, h, :c] = idx
            counts[r, h] = c
    if not per_head_counts:
        c0 = counts[:, :1]
        assert bool((counts == c0).all()) and bool((c0 == kmax).all())
        counts = None
    return keep, counts


@pytest.mark.parametrize("pattern,per_head,hole_filling", [
    ("random", False, False), ("prefix_then_jump", True, False), ("sink_recent", True, False),
    ("random", False, True), ("sink_recent", True, True),
])
def test_reference_compact_vs_naive(pattern, per_head, hole_filling):
    gen = torch.Generator().manual_seed(6)
    lens = [9, 20, 33] if per_head else [12, 20, 33]
    hkv, g, d, bs, kmax = 2, 3, 8, 8, 12
    k, v, bt = make_paged(gen, lens, hkv, d, bs, F16, kv_layout="NHD")
    keep, counts = make_keep(gen, lens, hkv, kmax, pattern, per_head, hole_filling)
    ref.check_keep_idx(keep, counts, torch.tensor(lens))
    scores = torch.rand(3, hkv * g, 40, generator=gen).to(DEVICE)
    wk, wv, ws = naive_compact(k, v, bt, keep, counts, scores)
    ref.compact_kv_batched(k, v, bt, keep.to(DEVICE), None if counts is None else counts.to(DEVICE), scores)
    assert torch.equal(k.cpu(), wk) and torch.equal(v.cpu(), wv) and torch.equal(scores.cpu(), ws)


def test_reference_compact_one_request_and_checks():
    gen = torch.Generator().manual_seed(7)
    k, v, bt = make_paged(gen, [30], 2, 8, 16, F32)
    keep = torch.tensor([[0, 5, 6, 29], [1, 2, 3, 4]], device=DEVICE)
    scores = torch.rand(4, 30, generator=gen).to(DEVICE)
    wk, wv, ws = naive_compact(k, v, bt, keep[None].cpu(), None, scores[None].cpu())
    ref.compact_kv_batched(k, v, bt, keep[None], scores=scores[None])
    assert torch.equal(k.cpu(), wk) and torch.equal(v.cpu(), wv) and torch.equal(scores.cpu(), ws[0])
    ref.check_keep_idx(torch.tensor([[0, 7, 2, 5]]))  # hole-filling
    with pytest.raises(ValueError):
        ref.check_keep_idx(torch.tensor([[0, 3, 2, 5]]))  # neither ascending nor hole-filling
    with pytest.raises(ValueError):
        ref.check_keep_idx(torch.tensor([[0, 3, 3]]))
    with pytest.raises(ValueError):
        ref.check_keep_idx(torch.tensor([[0, 3, 9]]), seq_lens=torch.tensor(9))
    ref.check_keep_idx(torch.tensor([[0, 3, 0]]), keep_counts=torch.tensor([2]))  # tail ignored


# ---------------------------------------------------------------------------------------
# 2. Triton vs reference
# ---------------------------------------------------------------------------------------

# (G, head_dim, block_size, dtype): every value of each axis appears in the
# first three, not the product; the other three combine them otherwise (extended run).
CONFIGS = [
    pytest.param(1, 64, 16, F32, id="G1-D64-bs16-fp32"),
    pytest.param(3, 128, 32, BF16, id="G3-D128-bs32-bf16"),
    pytest.param(8, 64, 128, F16, id="G8-D64-bs128-fp16"),
    pytest.param(3, 64, 16, F16, id="G3-D64-bs16-fp16", marks=pytest.mark.extended),
    pytest.param(8, 128, 32, F32, id="G8-D128-bs32-fp32", marks=pytest.mark.extended),
    pytest.param(1, 128, 128, BF16, id="G1-D128-bs128-bf16", marks=pytest.mark.extended),
]
HKV = 2


def ragged_lens(bs):
    return [1, bs + 5, 2 * bs - 3, 70]  # length 1, not multiples of the block size


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", CONFIGS)
def test_triton_window_scores(g, d, bs, dtype):
    gen = torch.Generator().manual_seed(g * 1000 + d + bs)
    lens = ragged_lens(bs)
    ws = [1, 6, 3, 11]  # with max_rows=16 and G>1 the window spans several q tiles (atomics)
    k, _, bt = make_paged(gen, lens, HKV, d, bs, dtype)
    cu = torch.tensor([0] + torch.tensor(ws).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), HKV * g, d, generator=gen).to(dtype)
    qpos = torch.cat([torch.arange(L - w, L) for L, w in zip(lens, ws)]).int()
    sl = torch.tensor(lens, dtype=torch.int32)
    scale = d**-0.5
    out0 = torch.rand(len(lens), HKV * g, max(lens) + 3, generator=gen)
    args = [t.to(DEVICE) for t in (q, cu)] + [k, bt] + [t.to(DEVICE) for t in (sl, qpos)]
    want = ref.window_scores_batched(*args, scale, out=out0.clone().to(DEVICE))
    got = tk().window_scores_batched(*args, scale, out=out0.clone().to(DEVICE), max_q_len=max(ws),
                                      split_len=32, block_n=16, max_rows=16)
    torch.testing.assert_close(got, want, **TOL[dtype])


@needs_triton
def test_triton_window_scores_default_tiling():
    """Default split/tiling path (one split, one q tile: no atomics), out allocated."""
    gen = torch.Generator().manual_seed(11)
    lens, ws = [40, 17], [8, 8]
    k, _, bt = make_paged(gen, lens, HKV, 64, 16, F16)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device=DEVICE)
    q = torch.randn(16, HKV * 4, 64, generator=gen).to(F16).to(DEVICE)
    qpos = torch.cat([torch.arange(L - w, L) for L, w in zip(lens, ws)]).int().to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    want = ref.window_scores_batched(q, cu, k, bt, sl, qpos, 0.125)
    got = tk().window_scores_batched(q, cu, k, bt, sl, qpos, 0.125)
    assert got.shape == want.shape == (2, HKV * 4, 40)
    torch.testing.assert_close(got, want, **TOL[F16])


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", CONFIGS)
@pytest.mark.parametrize("mode", ["plain", "gumbel", "lse"])
def test_triton_decode_scores(g, d, bs, dtype, mode):
    gen = torch.Generator().manual_seed(g * 1000 + d + bs + len(mode))
    lens = ragged_lens(bs)
    nreq, hq, t_buf = len(lens), HKV * g, max(lens) + 5
    k, _, bt = make_paged(gen, lens, HKV, d, bs, dtype)
    q = torch.randn(nreq, hq, d, generator=gen).to(dtype).to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    scores0 = torch.rand(nreq, hq, t_buf, generator=gen).to(DEVICE)
    tr = lse = None
    if mode == "gumbel":
        tau = torch.tensor([1.0, 0.7, 2.0, 1.3], device=DEVICE) if g == 3 else 1.5
        tr = ("gumbel", gumbel(gen, (nreq, hq, t_buf)).to(DEVICE), tau)
    if mode == "lse":
        dense = [ref.gather_dense(k, bt[r], L).float() for r, L in enumerate(lens)]
        lse = torch.stack([
            torch.logsumexp(torch.einsum("hgd,htd->hgt", q[r].float().reshape(HKV, g, d), kd) * scale, -1).reshape(-1)
            for r, kd in enumerate(dense)
        ])
    want = ref.accumulate_decode_scores(q, k, bt, sl, scores0.clone(), scale, tr, lse=lse)
    got = scores0.clone()
    scratch = torch.empty(nreq, hq, t_buf + 8, device=DEVICE) if g == 8 else None  # caller scratch
    ret = tk().accumulate_decode_scores(q, k, bt, sl, got, scale, tr, lse=lse, scratch=scratch,
                                        split_len=32, block_n=16)
    assert ret is got
    torch.testing.assert_close(got, want, **TOL[dtype])
    for r, L in enumerate(lens):  # columns past seq_len untouched
        assert torch.equal(got[r, :, L:], scores0[r, :, L:])


@needs_triton
def test_triton_decode_default_split():
    gen = torch.Generator().manual_seed(12)
    lens = [100, 3]
    k, _, bt = make_paged(gen, lens, HKV, 64, 32, BF16)
    q = torch.randn(2, HKV * 2, 64, generator=gen).to(BF16).to(DEVICE)
    sl = torch.tensor(lens, device=DEVICE)
    want = ref.accumulate_decode_scores(q, k, bt, sl, torch.zeros(2, 4, 100, device=DEVICE), 0.125)
    got = tk().accumulate_decode_scores(q, k, bt, sl, torch.zeros(2, 4, 100, device=DEVICE), 0.125)
    torch.testing.assert_close(got, want, **TOL[BF16])
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 4, device=DEVICE), atol=1e-4, rtol=0)


# out is rounded to the input dtype (and on GPU p is rounded to it before p @ V, as in
# flash-attn), so fp16/bf16 outputs agree to a few units in their last place.
OUT_TOL = {F32: dict(atol=2e-5, rtol=1e-4), F16: dict(atol=2e-3, rtol=2e-3), BF16: dict(atol=1e-2, rtol=1e-2)}


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", CONFIGS)
def test_triton_decode_attention(g, d, bs, dtype):
    gen = torch.Generator().manual_seed(g * 1000 + d + bs + 7)
    lens = ragged_lens(bs)
    nreq, hq, t_buf = len(lens), HKV * g, max(lens) + 5
    k, v, bt = make_paged(gen, lens, HKV, d, bs, dtype, kv_layout="HND" if g != 8 else None)
    q = torch.randn(nreq, hq, d, generator=gen).to(dtype).to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    scores0 = torch.rand(nreq, hq, t_buf, generator=gen).to(DEVICE)
    want_scores = scores0.clone()
    want = ref.decode_attention_with_scores(q, k, v, bt, sl, scale, want_scores)
    got_scores = scores0.clone()
    scratch = torch.empty(nreq, hq, t_buf + 8, device=DEVICE) if g == 8 else None  # caller scratch
    got = tk().decode_attention_with_scores(q, k, v, bt, sl, scale, got_scores, max_seq_len=max(lens),
                                            scratch=scratch, split_len=32, block_n=16)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, **OUT_TOL[dtype])
    torch.testing.assert_close(got_scores, want_scores, **TOL[dtype])
    for r, L in enumerate(lens):  # columns past seq_len untouched
        assert torch.equal(got_scores[r, :, L:], scores0[r, :, L:])
    # attention alone: the same output, no scores
    alone = tk().decode_attention_with_scores(q, k, v, bt, sl, scale, None, split_len=32, block_n=16)
    torch.testing.assert_close(alone, want, **OUT_TOL[dtype])
    # the scores it adds are the ones the separate scoring op adds
    separate = tk().accumulate_decode_scores(q, k, bt, sl, scores0.clone(), scale, split_len=32, block_n=16)
    torch.testing.assert_close(got_scores, separate, **TOL[dtype])


@needs_triton
def test_triton_decode_attention_default_split():
    """Default split/tiling (one split), an empty request, a q of another dtype than the cache."""
    gen = torch.Generator().manual_seed(14)
    lens = [100, 0, 3]
    k, v, bt = make_paged(gen, lens, HKV, 64, 32, F16)
    q = torch.randn(3, HKV * 4, 64, generator=gen).to(DEVICE)  # fp32 q, fp16 cache
    sl = torch.tensor(lens, device=DEVICE)
    want_s, got_s = torch.zeros(3, HKV * 4, 100, device=DEVICE), torch.zeros(3, HKV * 4, 100, device=DEVICE)
    want = ref.decode_attention_with_scores(q, k, v, bt, sl, 0.125, want_s)
    got = tk().decode_attention_with_scores(q, k, v, bt, sl, 0.125, got_s)
    assert got.dtype == F32
    torch.testing.assert_close(got, want, **OUT_TOL[F16])
    torch.testing.assert_close(got_s, want_s, **TOL[F16])
    assert not got[1].any() and not got_s[1].any()
    torch.testing.assert_close(got_s.sum(-1)[[0, 2]], torch.ones(2, HKV * 4, device=DEVICE), atol=1e-4, rtol=0)


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", CONFIGS)
@pytest.mark.parametrize("pattern,per_head,with_scores,hole_filling", [
    ("random", False, True, False),
    ("prefix_then_jump", True, True, False),
    ("sink_recent", True, False, False),
    ("random", True, True, True),
])
def test_triton_compact(g, d, bs, dtype, pattern, per_head, with_scores, hole_filling):
    gen = torch.Generator().manual_seed(g * 1000 + d + bs + len(pattern))
    lens = [bs + 5, 2 * bs - 3, 70]  # compaction needs at least kmax tokens unless per-head counts
    if per_head:
        lens = [1] + lens
    kmax = min(lens) if not per_head else 21
    k, v, bt = make_paged(gen, lens, HKV, d, bs, dtype, kv_layout="HND" if g != 8 else None)
    keep, counts = make_keep(gen, lens, HKV, kmax, pattern, per_head, hole_filling)
    scores = torch.rand(len(lens), HKV * g, max(lens) + 2, generator=gen).to(DEVICE) if with_scores else None
    k2, v2 = k.clone(), v.clone()
    s2 = None if scores is None else scores.clone()
    counts_d = None if counts is None else counts.to(DEVICE)
    ref.compact_kv_batched(k, v, bt, keep.to(DEVICE), counts_d, scores)
    tk().compact_kv_batched(k2, v2, bt, keep.to(DEVICE), counts_d, s2, block_j=8)
    assert torch.equal(k2, k) and torch.equal(v2, v)  # whole caches: nothing else touched
    if with_scores:
        assert torch.equal(s2, scores)


@needs_triton
def test_triton_compact_one_request_and_no_zero_tail():
    gen = torch.Generator().manual_seed(13)
    k, v, bt = make_paged(gen, [50], 2, 64, 16, BF16)
    keep = torch.stack([torch.randperm(50, generator=gen)[:20].sort().values for _ in range(2)]).to(DEVICE)
    sc = torch.rand(1, 6, 50, generator=gen).to(DEVICE)
    k2, v2, sc2 = k.clone(), v.clone(), sc.clone()
    ref.compact_kv_batched(k, v, bt, keep[None], scores=sc, zero_score_tail=False)
    tk().compact_kv_batched(k2, v2, bt, keep[None], scores=sc2, zero_score_tail=False)
    assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(sc, sc2)
    assert torch.equal(sc[..., 20:], sc2[..., 20:])


# ---------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------


def test_get_ops_dispatch():
    cpu = get_ops("cpu")
    assert cpu.backend == "torch"
    for name in OP_NAMES:
        assert callable(getattr(cpu, name))
    cuda = get_ops("cuda")
    assert cuda.backend == ("triton" if torch.cuda.is_available() and HAVE_TRITON else "torch")
    assert get_ops("cuda", prefer_triton=False).backend == "torch"


def mixed_device_calls():
    """(op, argument placed on the `meta` device, call) for every reference op that takes
    more than one tensor; the other tensors live on DEVICE."""
    gen = torch.Generator().manual_seed(50)
    k, v, bt = make_paged(gen, [9, 4], 2, 16, 8, F32)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    sl = torch.tensor([9, 4], device=DEVICE)
    cu = torch.tensor([0, 1, 2], device=DEVICE)
    scores = torch.zeros(2, 4, 9, device=DEVICE)
    keep = torch.tensor([[[0, 2], [1, 3]]] * 2, device=DEVICE)
    inputs, _ = merged_inputs(gen, 2, 16, 8, F32, tokens=9, retained=2, appended=1)
    meta = {name: x.to("meta") for name, x in
            dict(bt=bt, sl=sl, q_pos=sl - 1, keep=keep, scores=scores, key_slot=inputs["key_slot"]).items()}
    return [
        ("gather_dense", "block_table_row", lambda: ref.gather_dense(k, meta["bt"][0], 9)),
        ("window_scores", "q_positions", lambda: ref.window_scores(q, k, bt[0], 9, meta["q_pos"], 1.0)),
        ("window_scores_batched", "seq_lens",
         lambda: ref.window_scores_batched(q, cu, k, bt, meta["sl"], sl - 1, 1.0)),
        ("accumulate_decode_scores", "block_tables",
         lambda: ref.accumulate_decode_scores(q, k, meta["bt"], sl, scores, 1.0)),
        ("decode_attention_with_scores", "scores_out",
         lambda: ref.decode_attention_with_scores(q, k, v, bt, sl, 1.0, meta["scores"])),
        ("compact_kv_batched", "keep_idx", lambda: ref.compact_kv_batched(k, v, bt, meta["keep"])),
        ("merged_attention", "key_slot",
         lambda: ref.merged_attention(q[:1], sl[:1] - 1, 1.0, **{**inputs, "key_slot": meta["key_slot"]})),
    ]


def test_reference_ops_refuse_mixed_devices():
    """A tensor on another device is a clear ValueError naming the op, the argument and
    both devices, raised before any work (nothing is moved between devices)."""
    calls = mixed_device_calls()
    assert {op for op, _, _ in calls} >= set(OP_NAMES) - {"split_kv_cache"}  # one tensor: nothing to mix
    for op, arg, call in calls:
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert msg.startswith(f"{op}: {arg} is on meta but ") and str(torch.device(DEVICE).type) in msg, msg


@needs_triton
def test_triton_module_exposes_same_ops():
    import inspect

    mod = tk()
    for name in OP_NAMES:
        fn_t, fn_r = getattr(mod, name), getattr(ref, name)
        params_r = list(inspect.signature(fn_r).parameters)
        params_t = list(inspect.signature(fn_t).parameters)
        assert params_t[: len(params_r)] == params_r, name  # Triton may only add keyword options


# ---------------------------------------------------------------------------------------
# (d) attention of a MiniCache-merged layer
# ---------------------------------------------------------------------------------------


def merged_inputs(gen, g, d, bs, dtype, tokens, retained, appended, kv_layout=None):
    """A merged pair's caches (lower: `tokens` + `appended` slots, upper:
    `retained` + `appended`), slot maps and scales from a real merge."""
    from vllm_kvcompress.merge import merge_tensor

    hkv = 2
    lk, lv, lbt = make_paged(gen, [tokens + appended], hkv, d, bs, dtype, kv_layout=kv_layout)
    uk, uv, ubt = make_paged(gen, [retained + appended], hkv, d, bs, dtype, kv_layout=kv_layout)
    upper = torch.randn(hkv, tokens, d, generator=gen)
    key = merge_tensor(ref.gather_dense(lk, lbt[0], tokens).float().cpu(), upper, 0.6, retained)
    value = merge_tensor(ref.gather_dense(lv, lbt[0], tokens).float().cpu(), upper.flip(-1), 0.6, retained)
    return dict(lower_keys=lk, lower_values=lv, lower_blocks=lbt[0], upper_keys=uk, upper_values=uv,
                upper_blocks=ubt[0], upper_len=retained + appended, retained=retained,
                key_slot=key.slot.to(DEVICE), key_scale=key.scale.to(DEVICE),
                value_slot=value.slot.to(DEVICE), value_scale=value.scale.to(DEVICE)), hkv


def naive_merged_attention(query, q_pos, scale, inputs, sinks=None):
    """Key by key, as the design says (merge.py), then a plain softmax per query
    head (with its sink logit in the denominator, given `sinks`)."""
    lower_k = ref.gather_dense(inputs["lower_keys"], inputs["lower_blocks"], inputs["key_slot"].shape[1]).float()
    lower_v = ref.gather_dense(inputs["lower_values"], inputs["lower_blocks"], inputs["key_slot"].shape[1]).float()
    own_k = ref.gather_dense(inputs["upper_keys"], inputs["upper_blocks"], inputs["upper_len"]).float()
    own_v = ref.gather_dense(inputs["upper_values"], inputs["upper_blocks"], inputs["upper_len"]).float()
    tokens, retained = inputs["key_slot"].shape[1], inputs["retained"]
    n, hq, d = query.shape
    hkv = own_k.shape[0]
    out = torch.zeros(n, hq, d)
    for i in range(n):
        for h in range(hq):
            kvh = h // (hq // hkv)
            keys, values = [], []
            for j in range(int(q_pos[i]) + 1):
                for x, low, own, slot, sc in ((keys, lower_k, own_k, "key_slot", "key_scale"),
                                              (values, lower_v, own_v, "value_slot", "value_scale")):
                    if j >= tokens:
                        x.append(own[kvh, retained + j - tokens])
                    elif inputs[slot][kvh, j] >= 0:
                        x.append(own[kvh, int(inputs[slot][kvh, j])])
                    else:
                        x.append(low[kvh, j] * inputs[sc][kvh, j])
            x = torch.stack(keys).cpu() @ query[i, h].float().cpu() * scale
            p = torch.softmax(x, dim=0) if sinks is None else sink_softmax64(x, sinks[h]).float()
            out[i, h] = p @ torch.stack(values).cpu()
    return out


def test_reference_merged_attention_vs_naive():
    gen = torch.Generator().manual_seed(17)
    inputs, hkv = merged_inputs(gen, 2, 16, 8, F32, tokens=37, retained=4, appended=6)
    query = torch.randn(5, 2 * hkv, 16, generator=gen).to(DEVICE)
    q_pos = torch.tensor([3, 36, 37, 40, 42])
    got = ref.merged_attention(query, q_pos.to(DEVICE), 0.25, **inputs)
    torch.testing.assert_close(got.cpu(), naive_merged_attention(query, q_pos, 0.25, inputs), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("g, d, bs, dtype, retained", [(1, 16, 16, F32, 3), (4, 64, 16, F32, 0),
                                                      (3, 32, 32, BF16, 9), (2, 24, 16, F16, 5)])
def test_triton_merged_attention(g, d, bs, dtype, retained):
    gen = torch.Generator().manual_seed(19)
    inputs, hkv = merged_inputs(gen, g, d, bs, dtype, tokens=71, retained=retained, appended=9, kv_layout="HND")
    query = torch.randn(4, g * hkv, d, generator=gen).to(dtype).to(DEVICE)
    q_pos = torch.tensor([71, 75, 79, 20]).to(DEVICE)
    want = ref.merged_attention(query, q_pos, d ** -0.5, **inputs)
    got = tk().merged_attention(query, q_pos, d ** -0.5, **inputs, block_n=16)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


# ---------------------------------------------------------------------------------------
# attention sinks (gpt-oss): each head's sink logit in every softmax's denominator
# ---------------------------------------------------------------------------------------


def sink_softmax64(x, sink):
    """float64 softmax over `x` with one more logit, `sink`, in the denominator only."""
    x = torch.cat([x.double(), torch.tensor([float(sink)], dtype=torch.float64)])
    return softmax64(x)[:-1]


def random_sinks(gen, hq):
    """Around the logits' size and above (some heads give the sink most of their attention)."""
    return (torch.randn(hq, generator=gen) * 2 + 1.5).to(DEVICE)


def test_reference_ops_with_sinks_vs_naive():
    """Every scoring and attention op, with sinks, against float64 softmaxes
    written out: the probabilities (scores) sum to less than one per query
    and head, the output is their weighted sum of values."""
    gen = torch.Generator().manual_seed(61)
    hkv, g, d, bs = 2, 3, 16, 8
    hq, scale = hkv * g, 0.3
    sinks = random_sinks(gen, hq)
    # window scores: 4 queries of one request
    L = 21
    k, v, bt = make_paged(gen, [L, 13, 1], hkv, d, bs, F32)
    q = torch.randn(4, hq, d, generator=gen).to(DEVICE)
    qpos = torch.tensor([3, 10, 19, 20])
    got = ref.window_scores(q, k, bt[0], L, qpos.to(DEVICE), scale, sinks)
    kd = naive_dense(k, bt[0], L).cpu().double()
    want = torch.zeros(hq, L, dtype=torch.float64)
    for i, p_i in enumerate(qpos.tolist()):
        for h in range(hq):
            want[h, : p_i + 1] += sink_softmax64(kd[h // g, : p_i + 1] @ q[i, h].cpu().double() * scale, sinks[h])
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)
    assert (got.sum(-1).cpu() < 4 - 1e-3).all()  # the sinks took their share
    # decode scores (plain and Gumbel), decode attention: three requests
    lens = [L, 13, 1]
    sl = torch.tensor(lens, device=DEVICE)
    qd = torch.randn(3, hq, d, generator=gen).to(DEVICE)
    noise = gumbel(gen, (3, hq, 24)).to(DEVICE)
    tau = torch.tensor([0.5, 1.0, 2.5], device=DEVICE)
    plain = ref.accumulate_decode_scores(qd, k, bt, sl, torch.zeros(3, hq, 24, device=DEVICE), scale, sinks=sinks)
    noisy = ref.accumulate_decode_scores(qd, k, bt, sl, torch.zeros(3, hq, 24, device=DEVICE), scale,
                                         ("gumbel", noise, tau), sinks=sinks)
    fused = torch.zeros(3, hq, 24, device=DEVICE)
    out = ref.decode_attention_with_scores(qd, k, v, bt, sl, scale, fused, sinks=sinks)
    for r, n in enumerate(lens):
        kd, vd = (naive_dense(c, bt[r], n).cpu().double() for c in (k, v))
        for h in range(hq):
            x = kd[h // g] @ qd[r, h].cpu().double() * scale
            p = sink_softmax64(x, sinks[h])
            torch.testing.assert_close(plain[r, h, :n].cpu().double(), p, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fused[r, h, :n].cpu().double(), p, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[r, h].cpu().double(), p @ vd[h // g], atol=1e-5, rtol=1e-5)
            t = float(tau[r])
            want_noisy = sink_softmax64((x + noise[r, h, :n].cpu().double()) / t, float(sinks[h]) / t)
            torch.testing.assert_close(noisy[r, h, :n].cpu().double(), want_noisy, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"sinks must be float32 \[Hq=6\]"):
        ref.accumulate_decode_scores(qd, k, bt, sl, plain, scale, sinks=sinks[:3])
    with pytest.raises(ValueError, match="lse is only valid without"):
        ref.accumulate_decode_scores(qd, k, bt, sl, plain, scale, lse=torch.zeros(3, hq, device=DEVICE), sinks=sinks)
    # merged attention: the sink joins each query head's softmax over the merged keys
    inputs, hkv = merged_inputs(gen, g, d, bs, F32, tokens=37, retained=4, appended=6)
    query = torch.randn(5, hq, d, generator=gen).to(DEVICE)
    q_pos = torch.tensor([3, 36, 37, 40, 42])
    got = ref.merged_attention(query, q_pos.to(DEVICE), 0.25, **inputs, sinks=sinks)
    torch.testing.assert_close(got.cpu(), naive_merged_attention(query, q_pos, 0.25, inputs, sinks),
                               atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("g,d,bs,dtype", CONFIGS[:2])
def test_triton_ops_with_sinks(g, d, bs, dtype):
    """The Triton ops fold the sinks into their normalisers as the torch ops do
    (split keys, several query tiles, a Gumbel transform with per-request tau)."""
    gen = torch.Generator().manual_seed(g * 1000 + d + bs + 99)
    lens = ragged_lens(bs)
    nreq, hq, t_buf = len(lens), HKV * g, max(lens) + 5
    k, v, bt = make_paged(gen, lens, HKV, d, bs, dtype)
    sinks = random_sinks(gen, hq)
    scale = d**-0.5
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    # window scores
    ws = [1, 6, 3, 11]
    cu = torch.tensor([0] + torch.tensor(ws).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    qw = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype).to(DEVICE)
    qpos = torch.cat([torch.arange(L - w, L) for L, w in zip(lens, ws)]).int().to(DEVICE)
    want = ref.window_scores_batched(qw, cu, k, bt, sl, qpos, scale, max_seq_len=t_buf, sinks=sinks)
    got = tk().window_scores_batched(qw, cu, k, bt, sl, qpos, scale, max_seq_len=t_buf, max_q_len=max(ws),
                                     sinks=sinks, split_len=32, block_n=16, max_rows=16)
    torch.testing.assert_close(got, want, **TOL[dtype])
    # decode scores, plain and Gumbel
    q = torch.randn(nreq, hq, d, generator=gen).to(dtype).to(DEVICE)
    tau = torch.tensor([1.0, 0.7, 2.0, 1.3], device=DEVICE)
    for tr in (None, ("gumbel", gumbel(gen, (nreq, hq, t_buf)).to(DEVICE), tau)):
        want = ref.accumulate_decode_scores(q, k, bt, sl, torch.zeros(nreq, hq, t_buf, device=DEVICE), scale, tr,
                                            sinks=sinks)
        got = tk().accumulate_decode_scores(q, k, bt, sl, torch.zeros(nreq, hq, t_buf, device=DEVICE), scale, tr,
                                            sinks=sinks, split_len=32, block_n=16)
        torch.testing.assert_close(got, want, **TOL[dtype])
    # decode attention with scores
    want_s, got_s = (torch.zeros(nreq, hq, t_buf, device=DEVICE) for _ in range(2))
    want = ref.decode_attention_with_scores(q, k, v, bt, sl, scale, want_s, sinks=sinks)
    got = tk().decode_attention_with_scores(q, k, v, bt, sl, scale, got_s, max_seq_len=max(lens), sinks=sinks,
                                            split_len=32, block_n=16)
    torch.testing.assert_close(got, want, **OUT_TOL[dtype])
    torch.testing.assert_close(got_s, want_s, **TOL[dtype])
    # merged attention
    inputs, hkv = merged_inputs(gen, g, d, bs, dtype, tokens=71, retained=5, appended=9)
    query = torch.randn(4, g * hkv, d, generator=gen).to(dtype).to(DEVICE)
    q_pos = torch.tensor([71, 75, 79, 20]).to(DEVICE)
    want = ref.merged_attention(query, q_pos, scale, **inputs, sinks=sinks)
    got = tk().merged_attention(query, q_pos, scale, **inputs, sinks=sinks, block_n=16)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
