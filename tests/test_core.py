"""Plain-code pieces without an engine: selection, scorers, budgets, planner, cache layout, oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_kvcompress.cache_layout import LAYOUTS
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.kernels import get_ops
from vllm_kvcompress.kernels.torch_ops import pool_scores, reduce_gqa
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.registry import POLICIES
from vllm_kvcompress.schedule import RequestSchedule, layer_groups
from vllm_kvcompress.scorers import Observation, hash_uniform
from vllm_kvcompress.selection import select_keep
from vllm_kvcompress.token_state import RequestTokens

BLOCK = 32  # the engine's block size: the default rolling interval


def plan(cfg: KVCompressConfig, prompt_len: int, num_layers: int = 1):
    """The plan the scheduler resolves for such a request."""
    return resolve_plan(cfg, prompt_len, num_layers, BLOCK)


def compression(cfg: KVCompressConfig, prompt_len: int, num_layers: int, num_kv_heads: int, num_q_heads: int):
    return RequestTokens(plan(cfg, prompt_len, num_layers), num_layers, num_kv_heads, num_q_heads)


def test_select_keep_protects_sinks_and_recent_and_takes_top_scores():
    positions = torch.arange(20).expand(2, -1)
    scores = torch.zeros(2, 20)
    scores[0, 7], scores[0, 9], scores[1, 11], scores[1, 3] = 5, 4, 3, 2
    keep = select_keep(scores, positions, keep=8, sinks=2, recent=4)
    assert sorted(keep[0].tolist()) == [0, 1, 7, 9, 16, 17, 18, 19]
    assert sorted(keep[1].tolist()) == [0, 1, 3, 11, 16, 17, 18, 19]
    assert select_keep(scores, positions, keep=25, sinks=0, recent=0).shape == (2, 20)


def test_kept_tokens_fill_the_holes_and_recent_means_newest_position():
    # Physical order no longer chronological (an earlier compaction moved 19 to slot 2).
    positions = torch.tensor([[0, 1, 19, 3, 4, 5, 6, 7, 8, 9]])
    scores = torch.tensor([[0, 0, 0, 0, 0, 9, 0, 8, 0, 0.0]])
    keep = select_keep(scores, positions, keep=5, sinks=1, recent=2)
    # Keeps positions 0, 19, 9 (recent), 5, 7 (top scores); slots 0 and 2 stay,
    # the holes 1, 3, 4 take slots 5, 7, 9 in ascending order.
    assert keep.tolist() == [[0, 5, 2, 7, 9]]
    moved = keep != torch.arange(5)
    assert (keep[moved] >= 5).all()  # sources are never destinations


def test_span_carry_keeps_what_follows_a_kept_token():
    from vllm_kvcompress.selection import SpanCarry

    # Cache order is not chronological: position 9 sits in slot 2.
    positions = torch.tensor([[0, 1, 9, 3, 4, 5, 6, 7, 8, 2]])
    scores = torch.tensor([[0.0, 0, 0, 5, 0, 0, 0, 1, 0, 0]])  # position 3 scores 5, position 7 scores 1
    got = select_keep(scores, positions, keep=5, sinks=1, recent=1, selection=SpanCarry(span=3))
    # By position, carried: 0 sink | 1:0 2:0 3:5 4:5 5:5 6:0 7:1 8:1 | 9 recent -> keep 0, 9, 3, 4, 5.
    assert sorted(positions[0, got[0]].tolist()) == [0, 3, 4, 5, 9]
    # span 1 is plain top-k: 3 and 7.
    plain = select_keep(scores, positions, keep=4, sinks=1, recent=1, selection=SpanCarry(span=1))
    assert sorted(positions[0, plain[0]].tolist()) == [0, 3, 7, 9]


def test_span_carry_sinks_are_kept_and_start_no_span():
    from vllm_kvcompress.selection import SpanCarry

    positions = torch.arange(10).view(1, -1)
    # Position 0 is an attention sink (score 9); position 5 holds content (score 2).
    scores = torch.tensor([[9.0, 1, 0, 0, 0, 2, 0, 0, 0, 0]])
    carried = select_keep(scores, positions, keep=4, sinks=0, recent=1, selection=SpanCarry(span=3))
    # Without sink tokens the sink's span (0, 1, 2) takes the budget from 5's.
    assert sorted(carried[0].tolist()) == [0, 1, 2, 9]
    sunk = select_keep(scores, positions, keep=6, sinks=0, recent=1, selection=SpanCarry(span=3, sink_tokens=2))
    # Sinks 0 and 1 kept, then 5's span (5, 6, 7); 1's score is carried nowhere.
    assert sorted(sunk[0].tolist()) == [0, 1, 5, 6, 7, 9]
    with pytest.raises(ValueError, match="sink_tokens"):
        SpanCarry(sink_tokens=-1).validate()


def test_chunk_selection_keeps_whole_chunks_by_summed_score():
    from vllm_kvcompress.selection import ChunkSelection

    positions = torch.arange(12).view(1, -1)
    # Unprotected tokens 1..10 in chunks of 3: [1,2,3] [4,5,6] [7,8,9] [10].
    scores = torch.tensor([[0.0, 1, 1, 1, 0, 4, 0, 2, 2, 0, 9, 0]])
    got = select_keep(scores, positions, keep=8, sinks=1, recent=1, selection=ChunkSelection(chunk_length=3))
    # Sums 3, 4, 4, 9: chunk [10], then [4,5,6] (the earlier of the ties), then [7,8,9] truncated
    # to its first two tokens: 6 ranked tokens, plus sink 0 and recent 11.
    assert sorted(positions[0, got[0]].tolist()) == [0, 4, 5, 6, 7, 8, 10, 11]


def test_reduce_gqa_groups_consecutive_query_heads():
    att = torch.tensor([[1.0, 0], [3, 0], [0, 2], [0, 6]])  # 4 query heads, 2 kv heads (groups of 2)
    assert reduce_gqa(att, 2, "mean").tolist() == [[2.0, 0.0], [0.0, 4.0]]
    assert reduce_gqa(att, 2, "max").tolist() == [[3.0, 0.0], [0.0, 6.0]]


def test_pooling_matches_snapkv_reference_code():
    s = torch.rand(3, 50)
    assert torch.allclose(pool_scores(s, 5, "avg"), F.avg_pool1d(s, 5, 1, 2))
    assert torch.allclose(pool_scores(s, 7, "max"), F.max_pool1d(s, 7, 1, 3))


def test_hash_uniform_is_deterministic_and_spread():
    a = hash_uniform(1, torch.arange(10000))
    assert torch.equal(a, hash_uniform(1, torch.arange(10000)))
    assert not torch.equal(a, hash_uniform(2, torch.arange(10000)))
    assert 0 < a.min() and a.max() < 1 and abs(a.mean().item() - 0.5) < 0.02


def snapkv_by_hand(q, k, window, budget, kernel_size, kept_window=None):
    """methods.md's SnapKV steps written out for one layer (GQA mean). With
    `kept_window`, only the newest `kept_window` tokens are kept whole; the
    older window tokens are scored (and pooled) like the prefix."""
    hq, hkv = q.shape[0], k.shape[0]
    length = k.shape[1]
    kept = window if kept_window is None else kept_window
    kr = k.repeat_interleave(hq // hkv, 0)
    logits = q[:, -window:] @ kr.transpose(1, 2) / k.shape[-1] ** 0.5
    qpos = torch.arange(length - window, length).view(-1, 1)
    logits = logits.masked_fill(torch.arange(length).view(1, -1) > qpos, float("-inf"))
    att = logits.softmax(-1)[:, :, : length - kept].sum(1)
    att = att.view(hkv, -1, length - kept).mean(1)
    att = F.avg_pool1d(att, kernel_size, 1, kernel_size // 2)
    top = att.topk(budget - kept, -1).indices
    window_idx = torch.arange(length - kept, length).expand(hkv, -1)
    return torch.cat([top, window_idx], -1).sort(-1).values


@pytest.mark.parametrize("kept_window", [None, 3])
def test_snapkv_selection_matches_the_spec(kept_window):
    torch.manual_seed(0)
    hq, hkv, length, d = 6, 2, 90, 16
    q, k = torch.randn(hq, length, d), torch.randn(hkv, length, d)
    data = {"policy": "snapkv", "budget": 40, "window": 8}
    if kept_window is not None:
        data["kept_window"] = kept_window
    cfg = KVCompressConfig.from_dict(data)
    rc = compression(cfg, length, 1, hkv, hq)
    positions = torch.arange(length)
    rc.append(positions)
    mask = rc.observed(positions)
    assert mask.sum() == 8 and mask[-8:].all()  # the whole window is observed either way
    logits = q[:, mask] @ k.repeat_interleave(3, 0).transpose(1, 2) / d ** 0.5
    logits = logits.masked_fill(torch.arange(length).view(1, -1) > positions[mask].view(-1, 1), float("-inf"))
    rc.observe(0, logits, positions[mask])
    assert torch.equal(rc.select(0, 40).sort(-1).values, snapkv_by_hand(q, k, 8, 40, 5, kept_window))


def test_snapkv_kept_window_protects_only_the_newest_window_tokens():
    from vllm_kvcompress.scorers.snapkv import SnapKV

    assert SnapKV(window=64, kept_window=16).protected(100) == (0, 16)
    assert SnapKV(window=64, kept_window=16).min_budget() == 16
    assert SnapKV(window=64).protected(100) == (0, 64)  # -1: the whole window
    for bad in (0, 65, -2):
        with pytest.raises(ValueError, match="kept_window"):
            SnapKV(window=64, kept_window=bad).validate()


def test_streamingllm_keeps_sinks_and_recent():
    cfg = KVCompressConfig.from_dict({"policy": "streamingllm", "budget": 10, "sink_tokens": 3})
    rc = compression(cfg, 30, 2, 2, 4)
    rc.append(torch.arange(30))
    assert sorted(rc.select(1, 10)[0].tolist()) == [0, 1, 2, 23, 24, 25, 26, 27, 28, 29]


def test_compaction_moves_positions_and_scores_per_head():
    cfg = KVCompressConfig.from_dict({"policy": "h2o", "budget": 4, "recent_ratio": 0.5})
    rc = compression(cfg, 8, 1, 2, 4)
    rc.append(torch.arange(8))
    rc.attention[0] = torch.arange(32, dtype=torch.float32).view(4, 8)
    keep = torch.tensor([[0, 3, 6, 7], [1, 2, 6, 7]])
    rc.keep_selected(0, keep)
    rc.finish_compaction()
    assert rc.positions(0).tolist() == keep.tolist()
    rc.append(torch.tensor([8, 9]))
    assert rc.positions(0).tolist() == [[0, 3, 6, 7, 8, 9], [1, 2, 6, 7, 8, 9]]
    assert rc.attention[0][2].tolist() == [17.0, 18.0, 22.0, 23.0]  # query head 2 -> kv head 1


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_decode_scores_accumulate_in_place_in_one_buffer_per_interval(policy):
    """Decoding grows the score buffer once per `interval` tokens, not once per
    step; what the scorer sees is the sum (h2o) or the newest query (tova)."""
    cfg = KVCompressConfig.from_dict({"policy": policy, "budget": 16, "interval": 8})
    rc = compression(cfg, 20, 1, 2, 4)
    rc.append(torch.arange(20))
    steps = [torch.rand(4, 20 + i) for i in range(10)]
    buffers = set()
    for i, attention in enumerate(steps):
        if i:
            rc.append(torch.tensor([19 + i]))
        rc.accumulate(0, attention)
        buffers.add(rc.attention[0].data_ptr())
    assert len(buffers) == 2  # widths 20..29: one buffer up to 28 columns, one more after
    if policy == "h2o":
        want = sum(torch.nn.functional.pad(a, (0, 29 - a.shape[-1])) for a in steps)
    else:
        want = steps[-1]
    assert torch.allclose(rc._observed(0), want)
    rc.append(torch.tensor([29, 30]))  # two tokens not yet observed: zero scores
    assert rc._observed(0).shape == (4, 31) and not rc._observed(0)[:, 29:].any()


def test_planner_schedule():
    cfg = KVCompressConfig.from_dict({"policy": "h2o", "budget": 64})
    state = RequestSchedule.create(plan(cfg, 200))
    assert state.next_compression(100) is None  # still prefilling
    assert state.next_compression(200) == (64,)  # prefill ended over budget
    state.commit(200, (64,))
    assert state.num_evicted == [136] and state.physical(201) == (65,)
    assert state.next_compression(200 + 31) is None  # 95 < 64 + 32
    assert state.next_compression(200 + 32) == (64,)  # 96: one block to free
    snap = RequestSchedule.create(plan(KVCompressConfig.from_dict({"policy": "snapkv", "budget": 64}), 50))
    assert snap.next_compression(50) is None and snap.next_compression(500) is None  # never rolls


def test_planner_streams_a_prompt_in_chunks():
    cfg = KVCompressConfig.from_dict({"policy": "streamingllm", "budget": 64, "prompt_chunk": 32})
    state = RequestSchedule.create(plan(cfg, 200))
    assert state.tokens_until_due(0) == 96  # budget + chunk before the first eviction
    assert state.next_compression(95) is None and state.next_compression(96) == (64,)
    state.commit(96, (64,))
    assert state.tokens_until_due(96) == 32 and state.next_compression(127) is None
    assert state.max_physical(200) == 64 + 32  # what admitting it needs
    plain = RequestSchedule.create(plan(KVCompressConfig.from_dict({"policy": "streamingllm", "budget": 64}), 200))
    assert plain.tokens_until_due(0) == 200 and plain.next_compression(150) is None  # the prompt whole
    assert plain.max_physical(200) is None  # a fresh prompt must fit whole, as in vLLM


@pytest.mark.parametrize("config", [
    {"policy": "h2o", "budget": 64, "interval": 8},
    {"policy": "snapkv", "budget": 64},
    {"policy": "streamingllm", "budget": 48, "prompt_chunk": 40},
    {"policy": "rkv", "budget": 24, "interval": 8},  # trigger decode
    {"policy": "snapkv-span-window", "budget": 32, "decode_window": 24, "interval": 8},
    {"policy": "tova", "allocation": "pyramid", "budget": 64, "layer_groups": 4},
    {"policy": "adaptive", "budget": 48, "layer_groups": 2},
])
def test_a_quiet_request_is_passed_over_exactly_where_nothing_is_due(config):
    """The scheduler passes a request over with one comparison while its
    length is below `quiet_below`: at every length, with reported budgets,
    the cached schedule compresses and says `next_due` exactly as one whose
    cache is cleared before each call (the rules computed afresh)."""
    import copy
    import random

    rng = random.Random(str(config))
    cfg = KVCompressConfig.from_dict(config)
    groups = layer_groups(4, cfg.num_layer_groups)
    for prompt_len in (20, 150, 300):
        state = RequestSchedule.create(plan(cfg, prompt_len, 4), groups)
        logical, passed_over = 0, 0
        while logical < prompt_len + 300:
            if state.budgets_pending and logical >= prompt_len:  # the worker's report at prefill end
                state.set_layer_budgets([rng.randint(8, 64) for _ in range(4)])
            fresh = copy.deepcopy(state)
            fresh.quiet_below, fresh._room = 0, None
            passed_over += logical < state.quiet_below
            assert state.next_due(logical) == fresh.next_due(logical), logical
            targets = state.next_compression(logical)
            assert targets == fresh.next_compression(logical), logical
            if targets is not None:
                state.commit(logical, targets)
            cap = state.tokens_until_due(logical)
            chunk = 1 if logical >= prompt_len else min(rng.choice([1, 7, 64, 512]), prompt_len - logical)
            logical += max(1, chunk if cap is None else min(chunk, cap))
        assert passed_over > 200


@pytest.mark.parametrize("config", [
    {"policy": "h2o", "budget": 64, "interval": 8},
    {"policy": "snapkv", "budget": 64},
    {"policy": "streamingllm", "budget": 48, "prompt_chunk": 40},
    {"policy": "tova", "allocation": "pyramid", "budget": 64, "layer_groups": 4},
    {"policy": "h2o", "budget": 400},  # prompt within budget: compressed only while decoding
])
def test_a_resumed_request_compresses_where_its_first_life_did(config):
    """After preemption vLLM recomputes prompt and outputs as one prefill; its
    chunks end where the first life compressed, so the same compressions happen."""
    cfg = KVCompressConfig.from_dict(config)
    groups = layer_groups(4, cfg.num_layer_groups)
    prompt_len, total = 300, 520

    def run(first_chunk_end) -> list[tuple[int, tuple[int, ...]]]:
        state = RequestSchedule.create(plan(cfg, prompt_len, 4), groups)
        done, points = 0, []
        while done < total:
            targets = state.next_compression(done)
            if targets is not None:
                state.commit(done, targets)
                points.append((done, targets))
            cap = state.tokens_until_due(done)
            step = first_chunk_end(done)
            done = min(total, done + (step if cap is None else min(step, cap)))
        return points

    # First life: the prompt (vLLM's chunks of 256), then one token per step.
    first = run(lambda done: 256 if done < prompt_len else 1)
    # Resumed after preemption: everything in one prefill, capped only by the plan.
    resumed = run(lambda done: total)
    assert first == resumed and first
    state = RequestSchedule.create(plan(cfg, prompt_len, 4), groups)
    assert state.max_physical(total) < total  # admission needs only what the replay holds


def test_pyramid_budgets_follow_the_reference_schedule_and_group_into_tiers():
    cfg = KVCompressConfig.from_dict({"policy": "pyramidkv", "budget": 96, "window": 8, "layer_groups": 4})
    allocation = cfg.components().allocation
    # KVCache-Factory: min (96-8)//20 = 4, max 2*88-4 = 172, step (172-4)//3 = 56, + window.
    assert allocation.layer_budgets(96, 4, 1000, 8) == [180, 124, 68, 12]
    assert allocation.layer_budgets(96, 4, 150, 8) == [150, 114, 78, 42]  # short prompt: bottom keeps all
    state = RequestSchedule.create(plan(cfg, 1000, 4), layer_groups(4, 4))
    assert state.budgets == (180, 124, 68, 12)
    tiers_cfg = cfg.merged({"policy": "pyramidkv", "budget": 96, "window": 8})
    tiers = RequestSchedule.create(plan(tiers_cfg, 1000, 4), layer_groups(4, 2))
    assert tiers.budgets == (180, 68)  # a tier keeps its largest layer budget
    assert state.next_compression(1000) == (180, 124, 68, 12)
    with pytest.raises(KVCompressConfigError, match="layer_groups"):
        KVCompressConfig.from_dict({"policy": "pyramidkv", "budget": 96})  # needs groups
    with pytest.raises(KVCompressConfigError, match="engine setting"):
        cfg.merged({"layer_groups": 2})
    with pytest.raises(ValueError, match="valid values: \\[1, 2, 4\\]"):
        layer_groups(4, 3)


def test_adaptive_budgets_follow_attention_mass_and_wait_for_the_worker():
    from vllm_kvcompress.budgets import tokens_for_mass

    # 90% of [.5, .3, .1, .1] needs 3 tokens; of [.95, .05, 0, 0] one; rows need not be normalized.
    assert tokens_for_mass(torch.tensor([[0.1, 0.5, 0.1, 0.3], [0.0, 1.9, 0.1, 0.0]]), 0.9).tolist() == [3, 1]
    cfg = KVCompressConfig.from_dict({"policy": "adaptive", "budget": 64, "window": 8, "layer_groups": 4})
    allocation = cfg.components().allocation
    flat = torch.full((2, 100), 1.0)  # needs 90 tokens per head
    peaked = torch.zeros(2, 100)
    peaked[:, :10] = 1.0  # needs 9
    mixed = torch.stack([flat[0], peaked[0]])  # heads need 90 and 9: mean 49.5
    # total 4 * 64 = 256 shared in proportion 90 : 9 : 49.5 : 9, floor = window 8.
    needs = [90, 9, 49.5, 9]
    want = [max(8, int(256 * n / sum(needs))) for n in needs]
    assert allocation.attention_budgets([flat, peaked, mixed, peaked], 64, 8).tolist() == want == [146, 14, 80, 14]
    assert cfg.merged({"policy": "adaptive", "budget": 64, "window": 8, "floor": 20}).components().allocation \
        .attention_budgets([flat, peaked, mixed, peaked], 64, 8).tolist() == [146, 20, 80, 20]
    state = RequestSchedule.create(plan(cfg, 100, 4), layer_groups(4, 4))
    assert state.budgets_pending
    with pytest.raises(RuntimeError, match="not reported"):
        state.next_compression(100)
    state = RequestSchedule.create(plan(cfg, 100, 4), layer_groups(4, 2))
    state.set_layer_budgets(want)
    assert state.next_compression(100) == (100, 80)  # tiers keep their largest; none above the prompt
    # Within budget: never compressed.
    assert not RequestSchedule.create(plan(cfg, 64, 4), layer_groups(4, 4)).budgets_pending
    with pytest.raises(KVCompressConfigError, match="coverage"):
        cfg.merged({"policy": "adaptive", "budget": 64, "coverage": 1.5})


def test_adakv_shares_one_top_k_across_heads_with_a_floor():
    cfg = KVCompressConfig.from_dict({"policy": "adakv", "budget": 10, "window": 2, "alpha": 0.2})
    allocation = cfg.components().allocation
    ranked = torch.zeros(3, 40)
    ranked[0, :20] = torch.linspace(2.0, 1.0, 20)  # head 0 holds every high score
    ranked[1, :5] = 0.5
    ranked[2, :5] = 0.4
    # Floor 2 each; the other 30 - 6 slots all go to head 0's scores (its top 2 already taken).
    assert allocation.head_counts(ranked[None], [10]).tolist() == [[20, 5, 5]]
    assert allocation.head_counts(ranked[None], [10]).sum() == 30
    assert KVCompressConfig.from_dict({"policy": "adakv", "budget": 10, "window": 2, "alpha": 1.0}) \
        .components().allocation.head_counts(ranked[None], [10]).tolist() == [[10, 10, 10]]  # alpha 1: uniform


def test_adakv_with_alpha_one_selects_what_snapkv_selects():
    """Each head's floor is then the whole budget: no head can take from another."""
    torch.manual_seed(3)
    attention = torch.rand(4, 120) ** 4
    picks = {}
    for policy in ({"policy": "snapkv"}, {"policy": "adakv", "alpha": 1.0}, {"policy": "adakv"}):
        cfg = KVCompressConfig.from_dict({**policy, "budget": 40, "window": 8})
        state = compression(cfg, 120, num_layers=1, num_kv_heads=2, num_q_heads=4)
        state.append(torch.arange(120))
        state.accumulate(0, attention)
        keep = state.attention_budgets()[0] if state.plan.budgets_after_prompt else 40
        picks[policy.get("alpha", policy["policy"])] = (state.select(0, keep), state._dead_after.get(0))
    assert torch.equal(picks["snapkv"][0], picks[1.0][0]) and not picks[1.0][1].any()  # every slot live
    assert picks["adakv"][1].any()  # default alpha: heads keep unequal counts


def test_per_head_selection_pads_with_slots_that_stay_in_place():
    from vllm_kvcompress.selection import select_keep_per_head

    ranked = torch.tensor([[9.0, 0, 8, 0, 7, 0, 6, 5], [0, 0, 0, 0, 0, 0, 4, 3]])
    order, dead = select_keep_per_head(ranked[None], torch.tensor([[5, 2]]), keep=[5])
    order, dead = order[0], dead[0]
    # Head 0 keeps 0,2,4,6,7 (6, 7 move into holes 1, 3). Head 1 keeps 6, 7 and pads
    # with slots 0-2, which stay where they are and are dead; 6, 7 move into slots 3, 4.
    assert order.tolist() == [[0, 6, 2, 7, 4], [0, 1, 2, 6, 7]]
    assert dead.tolist() == [[False] * 5, [True, True, True, False, False]]


def test_cpu_layout_views_and_compaction_in_place():
    n, h, b, d = 5, 2, 4, 3
    cache = torch.zeros(n, h, b, 2 * d)
    k_view, v_view = LAYOUTS["CPU_ATTN"](cache)  # [N, B, H, D] views
    keys, values = torch.randn(h, 10, d), torch.randn(h, 10, d)
    block_ids = torch.tensor([3, 0, 4])  # shuffled blocks
    for t in range(10):
        k_view[block_ids[t // b], t % b] = keys[:, t]
        v_view[block_ids[t // b], t % b] = values[:, t]
    # K is stored transposed inside each (block, head) slab, V plainly.
    assert torch.equal(cache[3, 0].flatten()[: b * d].view(d, b)[:, 1], keys[0, 1])
    assert torch.equal(cache[3, 0].flatten()[b * d:].view(b, d)[1], values[0, 1])
    check_paged_compaction(cache, LAYOUTS["CPU_ATTN"], block_ids, keys, values)


@pytest.mark.parametrize("storage", ["HND", "NHD"])
def test_paged_layout_reader_and_compaction_in_place(storage):
    """vLLM 0.32's FLASH_ATTN cache through the kernel ops (torch ones here)."""
    n, h, b, d = 5, 2, 4, 3
    if storage == "HND":
        cache = torch.zeros(n, h, b, 2 * d)
    else:  # the same logical shape over [N, B, H, 2D] memory
        cache = torch.zeros(n, b, h, 2 * d).transpose(1, 2)
    keys, values = torch.randn(h, 10, d), torch.randn(h, 10, d)
    block_ids = torch.tensor([3, 0, 4])
    for t in range(10):
        cache[block_ids[t // b], :, t % b, :d] = keys[:, t]
        cache[block_ids[t // b], :, t % b, d:] = values[:, t]
    check_paged_compaction(cache, LAYOUTS["FLASH_ATTN"], block_ids, keys, values)


def check_paged_compaction(cache, views, block_ids, keys, values):
    """The views read what was written; compaction through the ops moves both K and V."""
    ops = get_ops("cpu")
    h = keys.shape[0]
    k_view, v_view = views(cache)
    assert torch.equal(ops.gather_dense(k_view, block_ids, 10), keys)
    assert torch.equal(ops.gather_dense(v_view, block_ids, 10), values)
    keep = select_keep(torch.rand(h, 10), torch.arange(10).expand(h, -1), 4, 1, 1)  # hole-filling order
    ops.compact_kv_batched(k_view, v_view, block_ids[None], keep[None])
    new_k, new_v = ops.gather_dense(k_view, block_ids, 4), ops.gather_dense(v_view, block_ids, 4)
    for head in range(h):
        assert torch.equal(new_k[head], keys[head, keep[head]])
        assert torch.equal(new_v[head], values[head, keep[head]])
    assert cache[1].abs().sum() == 0  # blocks the request does not own are untouched


def test_reference_decoder_without_compression_equals_transformers(tiny_model):
    """The oracle itself is checked: no compression -> HF greedy generation."""
    from kvc_tools.reference_decoder import ReferenceDecoder

    ref = ReferenceDecoder(tiny_model)
    prompt = list(range(10, 90))
    want = ref.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              min_new_tokens=24)[0, len(prompt):].tolist()
    assert ref.generate(prompt, 24)["tokens"] == want


def test_a_scorer_is_one_module_of_the_scorers_package():
    """A new scorer is its own file (discovered by name) plus a policy line in
    registry.py: knorm (kvpress's KnormPress) landed that way."""
    import pkgutil

    import vllm_kvcompress.scorers as package
    from vllm_kvcompress.registry import POLICIES
    from vllm_kvcompress.scorers import SCORERS
    from vllm_kvcompress.scorers.knorm import Knorm

    modules = {m.name for m in pkgutil.iter_modules(package.__path__)} - {"base"}
    assert {cls.__module__.rsplit(".", 1)[1] for cls in SCORERS.values()} == modules
    assert SCORERS["knorm"] is Knorm and POLICIES["knorm"].scorer == "knorm"
    keys = torch.tensor([[[3.0, 4.0], [0.0, 1.0], [1.0, 1.0]]])  # norms 5, 1, sqrt 2
    obs = Observation(attention=None, positions=torch.arange(3).view(1, 3), num_kv_heads=1, layer=0,
                      num_compressions=0, keys=keys)
    assert Knorm().score(obs).argsort(descending=True).tolist() == [[1, 2, 0]]


@pytest.mark.parametrize("policy", sorted(n for n in POLICIES if n not in ("none", "minicache")))
def test_a_quiet_step_observes_nothing(policy):
    """A step the worker passes over with integer tests (`RequestTokens.advance`:
    most decode steps) is one whose queries the scorer would not observe:
    wherever `observes_any` says none, `observed` marks none; for scorers with
    a fixed span, it says some exactly where `observed` marks some."""
    import random

    rng = random.Random(policy)
    budget = {"budget": 12, "interval": 8} if POLICIES[policy].trigger == "decode" else {"budget": 40}
    cfg = KVCompressConfig.from_dict({"policy": policy, **budget, "layer_groups": 2})
    for prompt_len in (30, 120):
        state = compression(cfg, prompt_len, num_layers=2, num_kv_heads=2, num_q_heads=4)
        for _ in range(200):
            state.next_due = rng.choice([None, rng.randint(0, 300)])
            first, n = rng.randint(0, 300), rng.choice([1, 1, 4, 64])
            observed = bool(state.observed(torch.arange(first, first + n)).any())
            fixed = state.scorer.observe.span(prompt_len, state.scorer.window_queries(), state.next_due) is not None
            assert state.observes_any(first, n) == observed if fixed else (observed <= state.observes_any(first, n))
