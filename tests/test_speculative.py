"""Speculative decoding (n-gram lookup, a draft model) with compression: the
tokens of the same compression without speculation (worker/speculation.py says how).

SmolLM2-135M copies lists, so n-gram drafts from a list in the prompt are often
accepted (each test asserts vLLM's acceptance counter moved) and often rejected.
The draft model is SmolLM2 cut to its first 26 of 30 layers: about half its
drafts are accepted; its cache is compacted with the target's kept positions.
Every composition below runs in one batch through per-request settings, once
without and once with speculation: a rejected draft's query scored (H2O, TOVA,
R-KV, Keyformer observe decode queries), a compression crossed inside a
verifying step, or a rejected draft's slot kept, changes tokens here. The
speculating engines also serve from the prefix cache, in prompt chunks,
preempted, and on an fp8 cache. The n-gram ones run in their own engine core processes: vLLM 0.32
rebinds its CPU kernels by scanning every loaded module, and fails on one numba (the n-gram
proposer's) loads into a process that already ran an engine. The draft model's load no numba
and run in this process (faster to start).
"""

from __future__ import annotations

import os
import random

import pytest

from helpers import Engine, engine_kwargs, requires_cpu_fp8

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
DRAFT_LAYERS = 26
NEW_TOKENS = 64
# The engines' own setting: per-layer budgets over three KV cache groups.
BASE = {"policy": "pyramidkv", "budget": 64, "layer_groups": 3}
SETTINGS = [
    None,  # the engine's (pyramidkv, once, per-layer groups)
    {"policy": "snapkv", "budget": 48},  # once
    {"policy": "h2o", "budget": 64, "interval": 16},  # rolling: every decode query observed
    {"policy": "tova", "budget": 64, "interval": 8},  # the last query replaces the rest
    {"policy": "keyformer", "budget": 64, "interval": 16},  # noisy logits
    {"policy": "rkv", "budget": 64},  # the window of queries before each compression
    {"policy": "adakv", "budget": 64},  # per-head budgets (masked attention)
    {"policy": "streamingllm", "budget": 48, "interval": 8},  # observes nothing
    # Rolling: accepted drafts' queries, turned back before RoPE, join the moments.
    {"policy": "expected_attention", "budget": 64, "trigger": "rolling", "interval": 16},
    # Repeat passes (requests of their own, drafted for too) before the request's second token.
    {"policy": "kvzip", "budget": 64},
]
PROMPTS_PER_SETTING = 2


def list_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that ask to repeat a list of 30 items: n-gram lookup finds drafts."""
    rng = random.Random(seed)
    words = "apple banana cherry grape lemon mango orange peach pear plum melon kiwi lime fig date".split()
    prompts = []
    for _ in range(count):
        items = [f"{rng.choice(words)} {rng.randrange(100)}" for _ in range(30)]
        text = f"Here is a list: {', '.join(items)}.\nRepeat the list exactly, twice: {', '.join(items[:3])}"
        prompts.append(tokenizer(text).input_ids)
    return prompts


def spec_counters(engine) -> dict[str, float]:
    from vllm.v1.metrics.reader import Counter

    return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in engine.llm.get_metrics()
            if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode_")}


@pytest.fixture(scope="module")
def smollm2() -> str:
    from kvc_tools.models import prepare_smollm2

    return str(prepare_smollm2())


@pytest.fixture(scope="module")
def batch(smollm2):
    from transformers import AutoTokenizer

    prompts = list_prompts(AutoTokenizer.from_pretrained(smollm2), len(SETTINGS) * PROMPTS_PER_SETTING)
    return prompts, [s for s in SETTINGS for _ in range(PROMPTS_PER_SETTING)]


def kwargs(model: str, **overrides) -> dict:
    return engine_kwargs(model, kv_compress=BASE, disable_log_stats=False, **overrides)


@pytest.fixture(scope="module")
def without_speculation(start_engine, smollm2, batch):
    engine = start_engine(**kwargs(smollm2))
    prompts, settings = batch
    tokens = engine.generate(prompts, NEW_TOKENS, settings)
    engine.close()
    return tokens


def proposer(name: str) -> dict:
    """The speculative config of a proposer: n-gram lookup, or the cut SmolLM2 as a draft model."""
    if name == "ngram":
        return SPECULATIVE
    from kvc_tools.models import prepare_smollm2_draft

    return {"model": str(prepare_smollm2_draft(DRAFT_LAYERS)), "num_speculative_tokens": 3}


def rows_for(name: str, batch) -> list[int]:
    """The batch's rows a proposer runs: all for n-gram, one per setting for
    the draft model (its 26 layers cost nearly the target's)."""
    prompts, _ = batch
    return list(range(len(prompts))) if name == "ngram" else list(range(0, len(prompts), PROMPTS_PER_SETTING))


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def speculating(request, smollm2, without_speculation):
    """Speculating, with prefix caching on. Started after the engine without
    speculation: each `LLM` takes over the process's metrics (the acceptance counters)."""
    engine = Engine(in_process=request.param != "ngram",
                    **kwargs(smollm2, speculative_config=proposer(request.param), enable_prefix_caching=True))
    engine.proposer = request.param
    yield engine
    engine.close()


@pytest.mark.extended
def test_speculation_gives_the_tokens_of_the_same_compression(speculating, without_speculation, batch):
    rows = rows_for(speculating.proposer, batch)
    prompts, settings = [batch[0][i] for i in rows], [batch[1][i] for i in rows]
    before = spec_counters(speculating)
    got = speculating.generate(prompts, NEW_TOKENS, settings)
    after = spec_counters(speculating)
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"], "no draft was accepted"
    assert after["num_draft_tokens"] - before["num_draft_tokens"] > after["num_accepted_tokens"] \
        - before["num_accepted_tokens"], "no draft was rejected"
    for i, a in zip(rows, got):
        assert a == without_speculation[i], f"prompt {i} ({settings[rows.index(i)]}): speculation changed the tokens"
    stats = speculating.stats()
    assert stats["free_blocks"] == stats["total_blocks"], "blocks were not returned to the pool"


@pytest.mark.extended
def test_prefix_cache_hits_inside_speculative_runs(speculating, without_speculation, batch):
    """The same prompts again: hits from the prefix cache (capped where each
    request's scorer observes), the same tokens."""
    rows = rows_for(speculating.proposer, batch)
    prompts, settings = [batch[0][i] for i in rows], [batch[1][i] for i in rows]
    before = spec_counters(speculating)
    got = speculating.generate_with_hits(prompts, NEW_TOKENS, settings)
    assert spec_counters(speculating)["num_accepted_tokens"] > before["num_accepted_tokens"]
    assert sum(hit for _, hit in got) > 0, "nothing was served from the prefix cache"
    for i, (a, _) in zip(rows, got):
        assert a == without_speculation[i], f"prompt {i} ({settings[rows.index(i)]}): a prefix-cache hit changed " \
                                            f"the tokens"


@pytest.mark.extended
@pytest.mark.parametrize("name", ["ngram", "draft_model"])
def test_preempted_and_chunked_speculative_runs(name, smollm2, without_speculation, batch):
    """A cache too small for the batch (preemptions: resumed requests replay
    their compressions) and prompts in 64-token chunks: the whole batch."""
    prompts, settings = batch
    rows = list(range(len(prompts)))
    # Admission that forecasts growth off: vLLM admits what fits now and preempts as the requests grow.
    engine = Engine(in_process=name != "ngram",
                    **engine_kwargs(smollm2, kv_compress={**BASE, "reserve_growth": 0}, disable_log_stats=False,
                                    speculative_config=proposer(name), max_model_len=512, num_gpu_blocks_override=60,
                                    max_num_batched_tokens=64))
    try:
        got = engine.generate(prompts, NEW_TOKENS, settings)
        stats = engine.stats()
        assert stats["preemptions"] > 0, "the cache was meant to be too small"
        assert spec_counters(engine)["num_accepted_tokens"] > 0
    finally:
        engine.close()
    for i, a in zip(rows, got):
        assert a == without_speculation[i], f"prompt {i} ({settings[rows.index(i)]}): preemption or chunking " \
                                            f"changed the tokens"


@pytest.mark.extended
@requires_cpu_fp8
def test_speculation_on_an_fp8_cache(smollm2, batch):
    """fp8 x compression x speculation: drafts verified over an fp8 cache keep
    the tokens of the same fp8 compression without speculation, with n-gram
    lookup and with a draft model (whose fp8 cache follows the target's)."""
    prompts, settings = batch
    # One prompt per setting that observes decode queries, and the engine's own.
    rows = [i for i, s in enumerate(settings) if s is None or s["policy"] in ("h2o", "tova", "rkv")]
    rows = rows[::PROMPTS_PER_SETTING]
    prompts, settings = [prompts[i] for i in rows], [settings[i] for i in rows]
    tokens = {}
    for name in (None, "ngram", "draft_model"):
        spec = None if name is None else proposer(name)
        engine = Engine(in_process=name != "ngram",
                        **kwargs(smollm2, speculative_config=spec, kv_cache_dtype="fp8_e4m3"))
        try:
            tokens[name] = engine.generate(prompts, NEW_TOKENS, settings)
            if spec is not None:
                assert spec_counters(engine)["num_accepted_tokens"] > 0, f"{name}: no draft was accepted"
        finally:
            engine.close()
    for name in ("ngram", "draft_model"):
        for i, (a, b) in enumerate(zip(tokens[name], tokens[None])):
            assert a == b, f"{settings[i]}: {name} speculation changed the tokens on fp8"


def test_other_proposers_are_refused(tiny_model):
    """An EAGLE head reads the target's hidden states: refused at startup, by name."""
    from vllm import LLM

    from vllm_kvcompress import KVCompressConfigError

    eagle = {"method": "eagle", "model": tiny_model, "num_speculative_tokens": 2}
    with pytest.raises(KVCompressConfigError, match="speculative decoding method 'eagle' \\(valid with "
                                                    "compression: ngram, draft_model"):
        LLM(**engine_kwargs(tiny_model, kv_compress="snapkv", kv_compress_budget=64, speculative_config=eagle))


# Model Runner V2 (KVC_TEST_RUNNER=mrv2, `pytest -m mrv2`): a few settings,
# one prompt each; the V1 runner runs the whole batch above.
MRV2_SETTINGS = [None, {"policy": "h2o", "budget": 64, "interval": 16}, {"policy": "tova", "budget": 64, "interval": 8}]


@pytest.fixture(scope="module")
def mrv2_without_speculation(smollm2, batch):
    prompts, settings = batch
    rows = [settings.index(s) for s in MRV2_SETTINGS]
    engine = Engine(**kwargs(smollm2))
    try:
        return rows, engine.generate([prompts[i] for i in rows], NEW_TOKENS, MRV2_SETTINGS)
    finally:
        engine.close()


@pytest.mark.mrv2
@pytest.mark.extended
@pytest.mark.skipif(os.environ.get("KVC_TEST_RUNNER") != "mrv2", reason="V1: the tests above")
@pytest.mark.parametrize("name", ["ngram", "draft_model"])
def test_speculation_on_model_runner_v2(name, smollm2, batch, mrv2_without_speculation):
    """On MRV2 the drafts are verified on its own path (device-side rejection,
    and a draft model's speculator with its own attention groups, whose slots
    and lengths are made physical): the tokens of the same compression
    without speculation, drafts accepted and rejected, the pool whole after."""
    from vllm_kvcompress import KVCompressConfigError
    from vllm_kvcompress.vllm_seam.engine_checks import MRV2_DRAFT_PROPOSE
    from vllm_kvcompress.vllm_seam.patches import has_row
    from vllm_kvcompress.vllm_seam.versions import support

    rows, expected = mrv2_without_speculation
    minor = support().minor
    if name == "draft_model" and not has_row(MRV2_DRAFT_PROPOSE, minor):
        # vLLM 0.34 rebuilt MRV2's draft speculator: refused at startup, by name.
        with pytest.raises(KVCompressConfigError, match=f"a draft model on Model Runner V2 of vLLM {minor}"):
            Engine(**kwargs(smollm2, speculative_config=proposer(name)))
        return
    engine = Engine(**kwargs(smollm2, speculative_config=proposer(name)))
    try:
        got = engine.generate([batch[0][i] for i in rows], NEW_TOKENS, MRV2_SETTINGS)
        counters = spec_counters(engine)
        stats = engine.stats()
    finally:
        engine.close()
    assert counters["num_accepted_tokens"] > 0, "no draft was accepted"
    assert counters["num_draft_tokens"] > counters["num_accepted_tokens"], "no draft was rejected"
    for setting, a, b in zip(MRV2_SETTINGS, got, expected):
        assert a == b, f"{setting}: speculation on Model Runner V2 changed the tokens"
    assert stats["free_blocks"] == stats["total_blocks"], "blocks were not returned to the pool"


@pytest.mark.parametrize("runner_v2", [True, None])  # None: vLLM 0.34, where Model Runner V2 is the only runner
def test_a_draft_model_on_model_runner_v2_is_refused_where_the_seam_has_no_row(runner_v2, monkeypatch):
    """MRV2's draft speculator is followed on vLLM 0.32-0.33 (a seam row);
    0.34 rebuilt it: a draft model there is refused, n-gram served. (The
    check itself, on the config it reads: no vLLM 0.34 runs here.)"""
    from types import SimpleNamespace

    from vllm_kvcompress import KVCompressConfigError
    from vllm_kvcompress.vllm_seam import engine_checks, versions
    from vllm_kvcompress.vllm_seam.versions import Support

    config = SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model"))
    if runner_v2 is not None:
        config.use_v2_model_runner = runner_v2
    engine_checks.check_speculation(config)  # the installed 0.32
    monkeypatch.setattr(versions, "support", lambda: Support("0.34.0", "0.34", serves=True, untested=True))
    with pytest.raises(KVCompressConfigError, match="a draft model on Model Runner V2 of vLLM 0.34"):
        engine_checks.check_speculation(config)
    engine_checks.check_speculation(SimpleNamespace(use_v2_model_runner=True,
                                                    speculative_config=SimpleNamespace(method="ngram")))
    config.use_v2_model_runner = False
    engine_checks.check_speculation(config)  # a V1 runner (0.32-0.33) serves it


def test_mrv2_draft_slots_and_lengths_are_physical():
    """MRV2's draft speculator (no engine): the slot mappings it computes
    through the runner's BlockTables become physical in place in vLLM group 0,
    padding stays, and its metadata's lengths are physical."""
    from dataclasses import dataclass, replace

    import torch

    from vllm_kvcompress.vllm_seam.worker.runner_view import PhysicalDraftTables
    from vllm_kvcompress.vllm_seam.worker.speculation import DraftSlots, draft_metadata

    bs = 4
    gathered = torch.tensor([[7, 3, 9, 0], [5, 6, 0, 0]])  # the step's rows (physical)

    class Tables:  # what MRV2's BlockTables computes: logical slots, here from a stale wider row
        input_block_tables = [gathered]
        slot_mappings = torch.full((2, 8), -1)

        def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens, out=None):
            out = self.slot_mappings if out is None else out
            out[:, : len(positions)] = positions * 1000  # anything logical
            return out[:, :num_tokens]

    slots = DraftSlots(evicted=torch.tensor([40, 0]), capacity=torch.tensor([3 * bs, 2 * bs]),
                       evicted_host=torch.tensor([40, 0]))
    tables = Tables()
    seen = PhysicalDraftTables(tables, slots, bs)
    assert seen.input_block_tables is tables.input_block_tables  # everything else is vLLM's
    # The prefill pass: request 0 has tokens 0..3 (logical 49..52), request 1 tokens 4..6 (6..8).
    positions = torch.tensor([49, 50, 51, 52, 6, 7, 8])
    out = seen.compute_slot_mappings(torch.arange(2), torch.tensor([0, 4, 7]), positions, 8)
    assert out[0, :7].tolist() == [9 * bs + 1, 9 * bs + 2, 9 * bs + 3, -1, 6 * bs + 2, 6 * bs + 3, -1]
    assert tables.slot_mappings[0, :7].tolist() == out[0, :7].tolist()  # in vLLM's own buffer
    assert tables.slot_mappings[1, :7].tolist() == (positions * 1000).tolist()  # other groups untouched
    # A decode step: one token a request.
    out = seen.compute_slot_mappings(torch.arange(2), torch.tensor([0, 1, 2]), torch.tensor([50, 7]), 2)
    assert out[0, :2].tolist() == [9 * bs + 2, 6 * bs + 3]

    @dataclass
    class Metadata:
        seq_lens: torch.Tensor
        seq_lens_cpu_upper_bound: torch.Tensor
        _num_computed_tokens_cache: object = None

        def replace(self, **kw):
            return replace(self, **kw)

    cm = Metadata(torch.tensor([53, 9, 0]), torch.tensor([55, 10, 0]))
    edited = draft_metadata(cm, slots)
    assert edited.seq_lens.tolist() == [13, 9, 0] and edited.seq_lens_cpu_upper_bound.tolist() == [15, 10, 0]
    assert cm.seq_lens.tolist() == [53, 9, 0]  # a copy: the runner's buffers stay logical


def test_settle_drops_rejected_tokens_and_returns_accepted_queries():
    """The worker's bookkeeping for one request (no engine): a step at
    positions 100..103 verifies 3 drafts, 2 are accepted."""
    import torch

    from vllm_kvcompress.config import KVCompressConfig
    from vllm_kvcompress.plan import resolve_plan
    from vllm_kvcompress.token_state import RequestTokens, SpeculativeQueries

    plan = resolve_plan(KVCompressConfig.from_dict({"policy": "tova", "budget": 32}), 100, 2, 16)
    state = RequestTokens(plan, num_layers=2, num_kv_heads=1, num_q_heads=2)
    state.append(torch.arange(0, 100))
    step = torch.arange(100, 104)
    # TOVA observes a step's last query; while verifying, each query counts as its own step.
    assert state.observed(step).tolist() == [False, False, False, True]
    assert state.observed(step, one_at_a_time=True).all()
    state.append(step)
    queries = torch.randn(4, 2, 8)
    for layer in range(2):
        state.hold_speculative(layer, SpeculativeQueries(queries, step))
    accepted = state.settle(103)  # drafts at 101 and 102 accepted, 103 rejected
    assert state.logical_len == 103 and state.num_tokens(0) == state.num_tokens(1) == 103
    assert sorted(accepted) == [0, 1]
    assert accepted[0].logical.tolist() == [100, 101, 102] and torch.equal(accepted[0].queries, queries[:3])
    assert not state.speculative  # held queries are settled once
    state.append(torch.arange(103, 104))  # the next step writes where the rejected draft was
    with pytest.raises(RuntimeError, match="the scheduler says 110"):
        state.settle(110)


def test_draft_slots_are_physical_and_stay_in_the_requests_blocks():
    """A draft model's slot mapping (no engine): request 0 has evicted 40 of
    its tokens, request 1 none; vLLM's padding stays padding, and a slot past
    a request's blocks is not written."""
    import torch

    from vllm_kvcompress.vllm_seam.worker.speculation import DraftSlots, physical_draft_slots

    bs = 4
    table = torch.tensor([[7, 3, 9, 0], [5, 6, 0, 0]])
    slots = DraftSlots(evicted=torch.tensor([40, 0]), capacity=torch.tensor([3 * bs, 2 * bs]),
                       evicted_host=torch.tensor([40, 0]))
    positions = torch.tensor([49, 50, 51, 52, 6, 7, 8])
    request_of = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    # What vLLM maps from logical positions (its table lookups; -1: a rejected token).
    vllm_slots = torch.tensor([11, 12, -1, 14, 6 * bs + 2, 6 * bs + 3, 0])
    got = physical_draft_slots(slots, positions, request_of, table, bs, vllm_slots)
    # Physical 9, 10, (rejected), 12 = past request 0's 3 blocks; 6, 7, 8 = past request 1's 2 blocks.
    assert got.tolist() == [9 * bs + 1, 9 * bs + 2, -1, -1, 6 * bs + 2, 6 * bs + 3, -1]


def test_draft_layers_follow_the_shared_groups_layers():
    """Draft layer d follows a layer of the group it shares, spread evenly;
    KV heads map when the counts differ."""
    from types import SimpleNamespace

    from vllm_kvcompress.vllm_seam.worker.speculation import draft_layers

    target = [SimpleNamespace(num_kv_heads=4) for _ in range(6)]
    drafts = {f"draft_model.model.layers.{i}.self_attn.attn": SimpleNamespace(num_kv_heads=2) for i in range(3)}
    got = draft_layers(drafts, target, group_of_layer=[0, 0, 0, 0, 1, 1], group=0)
    assert [d.follows for d in got] == [0, 1, 2]
    assert got[0].heads.tolist() == [0, 2]
    same = draft_layers({"draft_model.model.layers.0.self_attn.attn": SimpleNamespace(num_kv_heads=4)}, target,
                        group_of_layer=[0] * 6, group=0)
    assert same[0].heads is None


def test_parallel_drafting_is_refused():
    from types import SimpleNamespace

    from vllm_kvcompress import KVCompressConfigError
    from vllm_kvcompress.vllm_seam.engine_checks import check_speculation

    config = SimpleNamespace(use_v2_model_runner=False,
                             speculative_config=SimpleNamespace(method="draft_model", parallel_drafting=True))
    with pytest.raises(KVCompressConfigError, match="parallel drafting"):
        check_speculation(config)
