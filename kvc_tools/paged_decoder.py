"""The plugin's worker path on vLLM 0.32's GPU cache layout, without vLLM.

vLLM's CUDA build cannot be installed on the GPU machines this project can
borrow (it pins another torch, and its wheel exceeds what a run may carry),
so this harness stands in for the engine there. It is a Llama forward pass
in plain torch whose KV cache is paged as vLLM 0.32's FLASH_ATTN backend
holds it (per layer `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`,
physically NHD or HND), and whose compression goes through the plugin's own
worker code, driven the way vLLM drives it:

- the planner (`schedule.RequestSchedule`, the scheduler's state machine) says
  when to compress and to what physical lengths, as the scheduler does;
- `WorkerCompression.before_update_states` starts request states and runs the
  step's compactions (the `compact_kv_batched` op, MiniCache merges, block
  truncation: freed blocks go back to the harness's pool);
- `step_passes` builds the step's observed, fused, masked and merged
  queries; after each layer's attention its hooks run as in
  `vllm_seam/attention.py` (`StepPasses.after_attention`);
- requests are admitted while the blocks their plans bound fit the pool,
  prompts chunked to a token budget per step, finished requests release
  their blocks, as vLLM's scheduler does in the large (`generate`), which
  `benchmarks/harness_serving.py` uses to compare settings at the same KV
  memory; a hybrid model's sliding-window layers (`layer_types`) are vLLM's
  uncompressed KV cache group 0.

Attention itself (vLLM's kernel in the engine): prompt chunks through torch's
SDPA over the gathered cache, decode steps through the kernel op
`decode_attention_with_scores` (Triton on CUDA, torch elsewhere), one call for
all decoding requests of a layer. Rows the worker fuses (a decode query a
plain-softmax scorer observes) attend one key here, as vLLM's kernel does
under the plugin's metadata edit; the worker's `attend_fused` writes them.

Needs torch only (Triton on CUDA); `random_llama` makes weights without
transformers. On CPU (CI) its greedy tokens equal the reference decoder's on
the same model (tests/test_paged_decoder.py); on a GPU, scripts/gpu_check.sh
runs it on CUDA against the same run on CPU, with the per-layer hooks and the
compactions under `torch.cuda.set_sync_debug_mode("error")` (no host sync).
"""

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.kernels.torch_ops import split_kv_cache
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.schedule import RequestSchedule, cdiv, layer_groups
from vllm_kvcompress.sharding import ONE_DEVICE
from vllm_kvcompress.step_records import Compaction, StartedRequest, StepPlan, attach_step_plan
from vllm_kvcompress.vllm_seam.worker import WorkerCompression
from vllm_kvcompress.vllm_seam.worker.runner_view import V1View
from vllm_kvcompress.vllm_seam.worker.step_inputs import step_passes

LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps")


def random_llama(seed: int = 0, std: float = 0.1, **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """A small random Llama: (config, weights named as Hugging Face names them)."""
    cfg: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                               rms_norm_eps=1e-6)
    cfg.update(overrides)
    gen = torch.Generator().manual_seed(seed)
    h, d, hq, hkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape):
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": 1 + w(h),
               "lm_head.weight": w(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(hq * d, h), p + "self_attn.k_proj.weight": w(hkv * d, h),
            p + "self_attn.v_proj.weight": w(hkv * d, h), p + "self_attn.o_proj.weight": w(h, hq * d),
            p + "mlp.gate_proj.weight": w(cfg["intermediate_size"], h),
            p + "mlp.up_proj.weight": w(cfg["intermediate_size"], h),
            p + "mlp.down_proj.weight": w(h, cfg["intermediate_size"]),
        })
    return cfg, weights


@dataclass
class PagedLayer:
    """What the worker reads of a vLLM attention layer."""

    layer_name: str
    kv_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    impl: types.SimpleNamespace


class PagedDecoder:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, block_size: int = 16, num_blocks: int = 512,
                 layout: str = "NHD", ops: types.SimpleNamespace | None = None) -> None:
        """`ops`: the kernel op namespace the worker calls (default: by
        device, as the engine picks it); e.g. the Triton ops on CPU tensors
        under TRITON_INTERPRET=1."""
        if layout not in ("NHD", "HND"):
            raise ValueError(f"layout must be one of ['NHD', 'HND'], got {layout!r}")
        self.cfg = {k: config[k] for k in LLAMA_KEYS if k in config}
        self.device, self.dtype = torch.device(device), dtype
        self.w = {k: v.to(self.device, dtype) for k, v in weights.items()}
        self.num_layers = self.cfg["num_hidden_layers"]
        # A hybrid model (Gemma 3's layer_types): sliding-window layers run
        # uncompressed beside the compressed full-attention ones.
        layer_types = config.get("layer_types") or ["full_attention"] * self.num_layers
        self.sliding_window = config.get("sliding_window")
        self.compressed = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        self.compressed_index = {layer: c for c, layer in enumerate(self.compressed)}
        if len(self.compressed) < self.num_layers and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        self.hq, self.hkv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        self.d = self.cfg.get("head_dim") or self.cfg["hidden_size"] // self.hq
        self.scale = self.d ** -0.5
        self.block_size, self.num_blocks, self.layout = block_size, num_blocks, layout
        self.ops = ops
        inv_freq = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d))
        self.inv_freq = inv_freq.to(self.device)

    # ------------------------------------------------------------ model

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # Hugging Face's LlamaRMSNorm: normalise in float32, scale in the model's dtype.
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])
        return self.w[name] * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [n, H, D] rotated to logical `positions` [n] (rotate_half form)."""
        freqs = positions.to(self.device, torch.float32)[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        half = self.d // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def _new_cache(self) -> torch.Tensor:
        shape = (self.num_blocks, self.block_size, self.hkv, 2 * self.d) if self.layout == "NHD" else \
            (self.num_blocks, self.hkv, self.block_size, 2 * self.d)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # vLLM's logical shape either way: [num_blocks, H, block_size, 2 * D].
        return cache.transpose(1, 2) if self.layout == "NHD" else cache

    # ------------------------------------------------------------ decoding

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 configs: KVCompressConfig | list[KVCompressConfig] | None = None,
                 check_syncs: bool = False, max_batched_tokens: int | None = None,
                 times: StepTimes | None = None) -> list[dict]:
        """Greedy tokens of every prompt, batched as one engine would batch them,
        each with its config (one for all, or one per prompt; `layer_groups`,
        an engine setting, is the first one's).

        Scheduling, as vLLM's in the large: requests are admitted in order
        while the blocks they may still need fit the pool (`num_blocks`; a
        compressed request's need is its plan's bound, `max_physical`, and
        after its prompt the trigger's); each step computes every running
        request's next token, then prompt chunks up to `max_batched_tokens`
        (None: whole prompts), each ending where its next compression is due.
        A finished request's blocks and state are released the next step.

        `check_syncs` (CUDA): the per-layer hooks and each step's compactions
        run under torch.cuda.set_sync_debug_mode("error"): a host sync there raises.
        `times`: accumulates each step's time by part (the device synchronised
        around each part: for benchmarks, not with `check_syncs`).
        Returns per prompt: tokens, kept logical positions per compressed layer
        at the end (None: uncompressed), blocks held per KV cache group at the
        end, and the step it was admitted in.
        """
        if not isinstance(configs, list):
            configs = [configs or KVCompressConfig()] * len(prompts)
        bs = self.block_size
        group_of_layer = layer_groups(len(self.compressed), configs[0].num_layer_groups)
        num_groups = max(group_of_layer) + 1
        # A hybrid model's sliding-window layers are vLLM's KV cache group 0,
        # uncompressed; the compressed groups follow (the worker's `vllm_groups`).
        hybrid = int(len(self.compressed) < self.num_layers)  # 1: vLLM's group 0 is the sliding one
        vllm_groups = tuple(range(hybrid, num_groups + hybrid))
        layers = [PagedLayer(f"model.layers.{i}.self_attn.attn", self._new_cache(), self.hq, self.hkv,
                             types.SimpleNamespace(scale=self.scale)) for i in range(self.num_layers)]
        ids = [f"req-{i}" for i in range(len(prompts))]
        runner = types.SimpleNamespace(
            requests={rid: types.SimpleNamespace(block_ids=[[] for _ in range(num_groups + hybrid)]) for rid in ids},
            input_batch=types.SimpleNamespace(req_id_to_index={}))  # no vLLM block table to refill
        worker = WorkerCompression.__new__(WorkerCompression)
        worker.setup(V1View(runner), [layers[i] for i in self.compressed], group_of_layer, vllm_groups,
                     num_groups + hybrid, bs, split_kv_cache, ONE_DEVICE)
        if self.ops is not None:
            worker.ops = self.ops
        free = list(range(self.num_blocks))
        plans = {rid: RequestSchedule.create(resolve_plan(config, len(prompt), len(self.compressed), bs),
                                             group_of_layer)
                 for rid, prompt, config in zip(ids, prompts, configs)}
        prompt_of = dict(zip(ids, prompts))
        total = {rid: len(prompt) + max_new_tokens for rid, prompt in prompt_of.items()}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logical = dict.fromkeys(ids, 0)
        waiting, running, finished = list(ids), list[str](), list[str]()
        done: dict[str, dict] = {}
        admitted: dict[str, int] = {}
        step_index = 0
        while waiting or running:
            # Scheduler side: admission, then compressions due before this step, then what each request computes.
            need = sum(self._blocks_needed(plans[rid], logical[rid], total[rid], num_groups, hybrid)
                       for rid in running)
            started = []
            while waiting:
                rid = waiting[0]
                more = self._blocks_needed(plans[rid], 0, total[rid], num_groups, hybrid)
                if running and need + more > self.num_blocks:
                    break
                if more > self.num_blocks:
                    raise ValueError(f"{rid} needs {more} blocks, the pool holds {self.num_blocks}")
                running.append(waiting.pop(0))
                started.append(StartedRequest(rid, plans[rid].plan))
                admitted[rid] = step_index
                need += more
            compactions = []
            for rid in running:
                targets = plans[rid].next_compression(logical[rid])
                if targets is not None:
                    compactions.append(Compaction(rid, plans[rid].physical(logical[rid]), targets))
                    plans[rid].commit(logical[rid], targets)
            held = {rid: [list(b) for b in runner.requests[rid].block_ids] for rid in running}
            scheduler_output = types.SimpleNamespace(finished_req_ids=tuple(finished), preempted_req_ids=(),
                                                     total_num_scheduled_tokens=len(running))
            next_due = {rid: plans[rid].next_due(logical[rid]) for rid in running if plans[rid].plan is not None}
            evicted = {c.request_id: tuple(plans[c.request_id].num_evicted) for c in compactions}
            attach_step_plan(scheduler_output, StepPlan(started=started, compactions=compactions, evicted=evicted,
                                                        next_due=next_due, compressing=bool(next_due)))
            with _no_syncs(check_syncs and self.device.type == "cuda"), _timed(times, "compaction", self.device):
                worker.before_update_states(scheduler_output)
            for rid in finished:
                for row in runner.requests[rid].block_ids:
                    free.extend(row)
                    row.clear()
            finished = []
            for rid in running:  # blocks the compactions truncated return to the pool
                for before, after in zip(held[rid], runner.requests[rid].block_ids):
                    free.extend(before[len(after):])
            step_ids, chunks = [], []
            budget = max_batched_tokens
            for rid in sorted(running, key=lambda r: logical[r] < len(prompt_of[r])):  # decodes first
                prompt, pos = prompt_of[rid], logical[rid]
                if pos < len(prompt):
                    cap = plans[rid].tokens_until_due(pos)
                    end = len(prompt) if cap is None else pos + cap
                    if budget is not None:
                        end = min(end, pos + budget)
                    chunk = prompt[pos:end]
                else:
                    chunk = tokens[rid][-1:]
                if not chunk:
                    continue
                if budget is not None:
                    budget -= len(chunk)
                step_ids.append(rid)
                chunks.append(chunk)
            kind = "decode" if all(len(c) == 1 for c in chunks) else "mixed"
            with _timed(times, f"{kind}_step", self.device):
                last_hidden = self._step(worker, runner, layers, plans, step_ids, chunks, logical, group_of_layer,
                                         vllm_groups, free, check_syncs, times)
                logits = F.linear(self._norm(last_hidden, "model.norm.weight"), self.w["lm_head.weight"])
                sampled = logits.argmax(-1).tolist()
            if times is not None:
                times.count("steps", 1)
                times.count(f"{kind}_steps", 1)
                times.count(f"{kind}_tokens", len(step_ids))
                times.peak("most_running", len(running))
            for reported in worker.reported:  # rides back on the model output in the engine
                plans[reported.request_id].set_layer_budgets(reported.layer_budgets)
            worker.reported = []
            for rid, chunk, token in zip(step_ids, chunks, sampled):
                logical[rid] += len(chunk)
                if logical[rid] >= len(prompt_of[rid]):
                    tokens[rid].append(int(token))
                if len(tokens[rid]) == max_new_tokens:
                    state = worker.states.get(rid)
                    done[rid] = {"tokens": tokens[rid],
                                 "kept_positions": None if state is None else
                                 [state.positions(i) for i in range(len(self.compressed))],
                                 "blocks": [len(b) for b in runner.requests[rid].block_ids],
                                 "admitted": admitted[rid]}
                    running.remove(rid)
                    finished.append(rid)
            step_index += 1
        return [done[rid] for rid in ids]

    def _blocks_needed(self, plan: RequestSchedule, logical_len: int, total_len: int, num_groups: int,
                       hybrid: int) -> int:
        """Most blocks a request may hold from now until it has `total_len`
        tokens, over every KV cache group: its plan's bound (the whole prompt
        unless streamed, then the trigger's), all tokens when uncompressed."""
        held = total_len
        if plan.plan is not None and plan.budgets is not None:
            prompt_len = plan.plan.prompt_len
            if plan.prefill_checked:  # past the prompt's compression: as the trigger holds it
                held = max(max(plan.physical(logical_len)), plan.plan.trigger.held_after_prompt(
                    max(plan.budgets), prompt_len, total_len, plan.plan.interval))
            else:
                held = plan.max_physical(total_len) or total_len
        return num_groups * cdiv(min(held, total_len), self.block_size) + hybrid * cdiv(total_len, self.block_size)

    def _step(self, worker, runner, layers, plans, step_ids, chunks, logical, group_of_layer, vllm_groups, free,
              check_syncs, times):
        """One forward over every scheduled request's chunk; returns each one's last hidden state."""
        bs, num_groups = self.block_size, max(group_of_layer) + 1
        n_sched = np.array([len(c) for c in chunks])
        starts = np.concatenate([[0], np.cumsum(n_sched)[:-1]])
        positions = torch.cat([torch.arange(logical[rid], logical[rid] + len(c)) for rid, c in zip(step_ids, chunks)])
        physical = []  # per compressed group; the sliding group (hybrid) holds every position
        for g in range(num_groups):
            evicted = [plans[rid].num_evicted[g] for rid in step_ids]
            physical.append(positions - torch.from_numpy(np.repeat(evicted, n_sched)))
        by_vllm_group = {vg: physical[g] for g, vg in enumerate(vllm_groups)}
        if vllm_groups[0] == 1:
            by_vllm_group[0] = positions
        # Blocks for the new tokens, and each token's slot per group.
        for vg, phys in by_vllm_group.items():
            for rid, s, n in zip(step_ids, starts, n_sched):
                row = runner.requests[rid].block_ids[vg]
                while len(row) < cdiv(int(phys[s + n - 1]) + 1, bs):
                    row.append(free.pop(0))
        step = step_passes(worker, step_ids, starts, n_sched, np.array([logical[rid] for rid in step_ids]), positions,
                           physical)
        slots, tables, seq_lens = {}, {}, {}
        for vg, phys in by_vllm_group.items():
            slots[vg] = torch.tensor([runner.requests[rid].block_ids[vg][p // bs] * bs + p % bs
                                      for rid, s, n in zip(step_ids, starts, n_sched)
                                      for p in phys[s:s + n].tolist()]).to(self.device)
            rows = [runner.requests[rid].block_ids[vg] for rid in step_ids]
            table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
            for i, r in enumerate(rows):
                table[i, :len(r)] = torch.tensor(r)
            tables[vg] = table.to(self.device)
            lens = [int(phys[s + n - 1]) + 1 for s, n in zip(starts, n_sched)]
            # As the plugin edits vLLM's metadata: the kernel attends one key in
            # the compressed groups for the rows whose attention the worker's fused op computes.
            if vg in vllm_groups:
                for row in step.fused_rows if step is not None else ():
                    lens[row] = 1
            seq_lens[vg] = lens
        decoding = all(n == 1 for n in n_sched)
        w = self.w
        token_ids = torch.tensor([t for c in chunks for t in c], device=self.device)
        x = F.embedding(token_ids, w["model.embed_tokens.weight"])
        num_tokens = len(positions)
        for i, layer in enumerate(layers):
            p = f"model.layers.{i}."
            compressed = i in self.compressed_index
            vg = vllm_groups[group_of_layer[self.compressed_index[i]]] if compressed else 0
            h = self._norm(x, p + "input_layernorm.weight")
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(num_tokens, self.hq, self.d)
            k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(num_tokens, self.hkv, self.d)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(num_tokens, self.hkv, self.d)
            q, k = self._rope(q, positions), self._rope(k, positions)
            key_view, value_view = split_kv_cache(layer.kv_cache)
            slot = slots[vg]
            key_view[slot // bs, slot % bs] = k
            value_view[slot // bs, slot % bs] = v
            with _timed(times, "attention", self.device):
                out = self._attention(worker, q, key_view, value_view, tables[vg], seq_lens[vg], by_vllm_group[vg],
                                      starts, n_sched, decoding and compressed,
                                      None if compressed else self.sliding_window)
            out = out.view(num_tokens, -1)
            if step is not None and compressed:
                with _no_syncs(check_syncs and self.device.type == "cuda"), _timed(times, "hooks", self.device):
                    step.after_attention(layer.layer_name, q, layer.kv_cache, out)
            x = x + F.linear(out, w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate, up = F.linear(h, w[p + "mlp.gate_proj.weight"]), F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        return x[torch.as_tensor(starts + n_sched - 1, device=self.device)]

    def _attention(self, worker, q, key_view, value_view, table, seq_lens, physical, starts, n_sched, decoding,
                   window):
        """vLLM's kernel: paged decode attention (the kernel op) when every row
        decodes, else SDPA per request over its gathered cache (`window`: a
        sliding-window layer's keys, the last `window` positions)."""
        if decoding:
            return worker.ops.decode_attention_with_scores(
                q, key_view, value_view, table, torch.tensor(seq_lens, device=self.device), self.scale,
                None, max_seq_len=max(seq_lens))
        out = torch.empty(q.shape[0], self.hq, self.d, dtype=self.dtype, device=self.device)
        for j, (s, n) in enumerate(zip(starts, n_sched)):
            keys = worker.ops.gather_dense(key_view, table[j], seq_lens[j]).unsqueeze(0)
            values = worker.ops.gather_dense(value_view, table[j], seq_lens[j]).unsqueeze(0)
            key_slot = torch.arange(seq_lens[j], device=self.device)
            query_slot = physical[s:s + n].to(self.device).unsqueeze(1)
            mask = key_slot <= query_slot
            if window is not None:
                mask &= key_slot > query_slot - window
            qj = q[s:s + n].transpose(0, 1).unsqueeze(0)
            out[s:s + n] = F.scaled_dot_product_attention(qj, keys, values, attn_mask=mask, scale=self.scale,
                                                          enable_gqa=True)[0].transpose(0, 1)
        return out


class StepTimes:
    """Seconds by part of a step, and counts, summed over a run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds

    def count(self, what: str, n: int) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def peak(self, what: str, n: int) -> None:
        self.counts[what] = max(self.counts.get(what, 0), n)


@contextlib.contextmanager
def _timed(times: StepTimes | None, part: str, device: torch.device):
    if times is None:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.add(part, time.perf_counter() - start)


@contextlib.contextmanager
def _no_syncs(enabled: bool):
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
