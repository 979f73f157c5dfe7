"""Helpers shared by the engine tests (imported as `helpers`)."""

from __future__ import annotations

import contextlib
import gc
import math
import random

BLOCK_SIZE = 32  # small blocks: evictions free blocks at small budgets


def _cpu_fp8_mark():
    import pytest

    from vllm_kvcompress.cache_layout import cpu_fp8_unserved

    why = cpu_fp8_unserved()
    return pytest.mark.skipif(why is not None, reason=f"fp8 KV cache: {why}")


# On an engine test that holds an fp8 cache: skipped, naming the instruction
# set, where vLLM's CPU attention cannot hold one (AVX2 without AVX-512).
requires_cpu_fp8 = _cpu_fp8_mark()


def engine_kwargs(model: str, **overrides) -> dict:
    kwargs = dict(
        model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
        max_model_len=1024, seed=0,
        # Off unless a test asks: a repeated prompt would hit the prefix cache
        # and skip prefill (same answers, tests/test_prefix_caching.py).
        enable_prefix_caching=False,
    )
    kwargs.update(overrides)
    if not kwargs["enforce_eager"] and _interpreted_jit_warmup():
        # vLLM 0.34 warms up its Triton kernels unless eager; here Triton's
        # interpreter runs them (the stub backend), and it cannot run the
        # top-k/top-p sampler kernel (`tl.range` yields Python ints there).
        # The tests sample greedily, which never calls that kernel.
        kwargs["kernel_config"] = {"enable_jit_warmup": False}
    return kwargs


def vllm_at_least(minor: str) -> bool:
    """Whether the installed vLLM is `minor` ("0.34") or newer (read without importing it)."""
    from importlib.metadata import version

    from vllm_kvcompress.vllm_seam.versions import minor_key, minor_of

    installed = minor_of(version("vllm"))
    return installed is not None and minor_key(installed) >= minor_key(minor)


def _interpreted_jit_warmup() -> bool:
    """Whether this vLLM has a JIT kernel warm-up (0.34 on) that Triton's interpreter would run."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1" and vllm_at_least("0.34")


@contextlib.contextmanager
def all_cores():
    """This test process on every core while it starts processes that need
    them (tensor- and data-parallel engines and servers): conftest pins each
    xdist worker to one, and its children inherit the pin."""
    import os

    cores = os.environ.get("KVC_TEST_CORES")
    if not cores:
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


class Engine:
    """A started `LLM`, closed by `close()` (fixtures call it at teardown).

    `in_process`: the engine core runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): the same scheduler, worker and
    plugin, started in a few seconds instead of ~25 (no spawned process
    importing vLLM again). Tensor- and data-parallel engines need processes."""

    def __init__(self, in_process: bool = False, **kwargs) -> None:
        import pytest
        import vllm.envs
        from vllm import LLM

        import vllm_kvcompress  # noqa: F401  (LLM(kv_compress=...) keywords)

        if not in_process:
            with all_cores():  # its processes inherit the cores it starts on
                self.llm = LLM(**kwargs)
            return
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            vllm.envs.disable_envs_cache()
            self.llm = LLM(**kwargs)
        vllm.envs.disable_envs_cache()  # the engine cached the environment

    def generate(self, prompts: list[list[int]], max_tokens: int = 40, overrides=None) -> list[list[int]]:
        """Greedy tokens per prompt; `overrides[i]` is prompt i's kv_compress extra_args."""
        return [tokens for tokens, _ in self.generate_with_hits(prompts, max_tokens, overrides)]

    def generate_with_hits(self, prompts: list[list[int]], max_tokens: int = 40,
                           overrides=None, salts=None) -> list[tuple[list[int], int]]:
        """(greedy tokens, prompt tokens served from the prefix cache) per
        prompt; `salts[i]`: prompt i's cache_salt (None: none)."""
        from vllm import SamplingParams

        overrides = overrides or [None] * len(prompts)
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                           extra_args=None if o is None else {"kv_compress": o})
            for o in overrides
        ]
        inputs = [{"prompt_token_ids": p, **({"cache_salt": s} if s else {})}
                  for p, s in zip(prompts, salts or [None] * len(prompts))]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    def stats(self) -> dict:
        import vllm_kvcompress

        return vllm_kvcompress.stats(self.llm)

    def close(self) -> None:
        if not hasattr(self, "llm"):  # closed already (a fixture closes early, the factory at the end)
            return
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


@contextlib.contextmanager
def in_process_engine(**kwargs):
    """An `Engine` whose core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):
    `step()` is one scheduler step, and the pool can be read between steps."""

    engine = Engine(in_process=True, **kwargs)
    try:
        yield engine
    finally:
        engine.close()


def random_prompts(lengths, seed: int = 0, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def plain_best(values: list[float], k: int) -> list[int]:
    """The k highest, ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def plain_head_counts(ranked: list[list[float]], budget: int, alpha: float) -> list[int]:
    """AdaKV (methods.md): each head its own top alpha * budget, then one top of
    the rest over every head, budget x heads in all; ties to the lower (head, token)."""
    heads, tokens = len(ranked), len(ranked[0])
    floor = min(int(alpha * budget), tokens)
    own = [set(plain_best(row, floor)) for row in ranked]
    rest = [-math.inf if i in own[h] else ranked[h][i] for h in range(heads) for i in range(tokens)]
    shared = plain_best(rest, min(budget, tokens) * heads - floor * heads)
    return [floor + sum(1 for j in shared if j // tokens == h) for h in range(heads)]


def preempted_second_turns(engine, reference, firsts, configs, tails, fillers, first_tokens: int,
                           filler_tokens: int, turn_tokens: int = 160) -> None:
    """`reuse` under a pool too small for the second turns beside growing
    uncompressed neighbours (sent first): second turns start from their
    first turn's state, some are preempted after that and resume from it,
    and each equals the reference continuing the first turn's state; the
    pool is whole afterwards."""
    from vllm import SamplingParams

    from vllm_kvcompress.config import KVCompressConfig

    turn1 = engine.generate(firsts, first_tokens, configs)
    seconds = [p + t + tail for p, t, tail in zip(firsts, turn1, tails)]
    before = engine.stats()
    params = [SamplingParams(max_tokens=turn_tokens if c else filler_tokens, temperature=0, ignore_eos=True,
                             extra_args=None if c is None else {"kv_compress": c})
              for c in [None] * len(fillers) + list(configs)]
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in fillers + seconds], params, use_tqdm=False)
    stats = engine.stats()
    assert stats["preemptions"] > before["preemptions"], "the cache was meant to be too small"
    assert stats["states_reused"] - before["states_reused"] == len(firsts)
    assert any("#preempted" in k and r["tokens_reused"] for k, r in stats["requests"].items()), \
        "a second turn was meant to be preempted after it started from its state"
    for first, config, second, out in zip(firsts, configs, seconds, outs[len(fillers):]):
        cfg = KVCompressConfig.from_dict(config)
        resume = reference.generate(first, first_tokens, cfg, block_size=BLOCK_SIZE)
        want = reference.generate(second, turn_tokens, cfg, block_size=BLOCK_SIZE, resume=resume)
        assert list(out.outputs[0].token_ids) == want["tokens"], config
    assert stats["free_blocks"] == stats["total_blocks"]


def reused_turns(engine, reference, firsts, configs, tails, new_tokens: int, block_size: int = BLOCK_SIZE):
    """Conversations with `reuse` (a conversation per config), batched, one
    turn per entry of `tails`: each turn equals the reference continuing its
    own state of the turn before, and each later turn's prefix-cache hit is
    exactly that turn's history. Turn t + 1's prompt is turn t's prompt,
    answer and `tails[t][i]`; returns the prompts after the last turn."""
    from vllm_kvcompress.config import KVCompressConfig

    prompts, wants = list(firsts), [None] * len(firsts)
    for turn, tail in enumerate(tails):
        got = engine.generate_with_hits(prompts, new_tokens, configs)
        for i, (prompt, config, (tokens, hit)) in enumerate(zip(prompts, configs, got)):
            want = reference.generate(prompt, new_tokens, KVCompressConfig.from_dict(config), block_size=block_size,
                                      resume=wants[i])
            assert tokens == want["tokens"], (turn, config)
            if turn:
                assert hit == len(wants[i]["resume"]["history"]), (turn, config, hit)
            wants[i] = want
        prompts = [p + tokens + t for p, (tokens, _), t in zip(prompts, got, tail)]
    return prompts
