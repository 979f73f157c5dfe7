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
- `WorkerCompression.observation` builds the step's observed, fused, masked
  and merged queries; after each layer's attention its hooks run as in
  `vllm_seam/attention.py` (`StepPasses.after_attention`).

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
                 check_syncs: bool = False) -> list[dict]:
        """Greedy tokens of every prompt, batched as one engine would batch them,
        each with its config (one for all, or one per prompt; `layer_groups`,
        an engine setting, is the first one's).

        `check_syncs` (CUDA): the per-layer hooks and each step's compactions
        run under torch.cuda.set_sync_debug_mode("error"): a host sync there raises.
        Returns per prompt: tokens, kept logical positions per layer at the
        end (None: uncompressed), blocks held per group at the end.
        """
        if not isinstance(configs, list):
            configs = [configs or KVCompressConfig()] * len(prompts)
        bs = self.block_size
        group_of_layer = layer_groups(self.num_layers, configs[0].num_layer_groups)
        num_groups = max(group_of_layer) + 1
        layers = [PagedLayer(f"model.layers.{i}.self_attn.attn", self._new_cache(), self.hq, self.hkv,
                             types.SimpleNamespace(scale=self.scale)) for i in range(self.num_layers)]
        ids = [f"req-{i}" for i in range(len(prompts))]
        runner = types.SimpleNamespace(
            requests={rid: types.SimpleNamespace(block_ids=[[] for _ in range(num_groups)]) for rid in ids},
            input_batch=types.SimpleNamespace(req_id_to_index={}))  # no vLLM block table to refill
        worker = WorkerCompression.__new__(WorkerCompression)
        worker.setup(runner, layers, group_of_layer, tuple(range(num_groups)), num_groups, bs, split_kv_cache,
                     ONE_DEVICE)
        if self.ops is not None:
            worker.ops = self.ops
        free = list(range(self.num_blocks))
        plans, started = {}, []
        for rid, prompt, config in zip(ids, prompts, configs):
            resolved = resolve_plan(config, len(prompt), self.num_layers, bs)
            plans[rid] = RequestSchedule.create(resolved, group_of_layer)
            started.append(StartedRequest(rid, resolved))
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        logical = dict.fromkeys(ids, 0)
        while any(len(tokens[rid]) < max_new_tokens for rid in ids):
            # Scheduler side: compressions due before this step, then what each request computes.
            compactions = []
            for rid in ids:
                plan = plans[rid]
                targets = plan.next_compression(logical[rid]) if len(tokens[rid]) < max_new_tokens else None
                if targets is not None:
                    compactions.append(Compaction(rid, plan.physical(logical[rid]), targets))
                    plan.commit(logical[rid], targets)
            held = {rid: [list(b) for b in runner.requests[rid].block_ids] for rid in ids}
            scheduler_output = types.SimpleNamespace(finished_req_ids=(), preempted_req_ids=())
            next_due = {rid: plans[rid].next_due(logical[rid]) for rid in ids if plans[rid].plan is not None}
            attach_step_plan(scheduler_output, StepPlan(started=started, compactions=compactions, next_due=next_due,
                                                        compressing=bool(next_due)))
            with _no_syncs(check_syncs and self.device.type == "cuda"):  # the step's compactions
                worker.before_update_states(scheduler_output)
            started = []
            for rid in ids:  # blocks the compactions truncated return to the pool
                for before, after in zip(held[rid], runner.requests[rid].block_ids):
                    free.extend(before[len(after):])
            step_ids, chunks = [], []
            for rid, prompt in zip(ids, prompts):
                if len(tokens[rid]) >= max_new_tokens:
                    continue
                pos = logical[rid]
                if pos < len(prompt):
                    cap = plans[rid].tokens_until_due(pos)
                    chunk = prompt[pos:] if cap is None else prompt[pos:pos + cap]
                else:
                    chunk = tokens[rid][-1:]
                step_ids.append(rid)
                chunks.append(chunk)
            last_hidden = self._step(worker, runner, plans, step_ids, chunks, logical, group_of_layer, free,
                                     check_syncs)
            for reported in worker.reported:  # rides back on the model output in the engine
                plans[reported.request_id].set_layer_budgets(reported.layer_budgets)
            worker.reported = []
            logits = F.linear(self._norm(last_hidden, "model.norm.weight"), self.w["lm_head.weight"])
            for rid, chunk, token in zip(step_ids, chunks, logits.argmax(-1).tolist()):
                logical[rid] += len(chunk)
                if logical[rid] >= len(prompts[ids.index(rid)]):
                    tokens[rid].append(int(token))
        out = []
        for rid in ids:
            state = worker.states.get(rid)
            out.append({"tokens": tokens[rid],
                        "kept_positions": None if state is None else [state.positions(i)
                                                                      for i in range(self.num_layers)],
                        "blocks": [len(b) for b in runner.requests[rid].block_ids]})
        return out

    def _step(self, worker, runner, plans, step_ids, chunks, logical, group_of_layer, free, check_syncs):
        """One forward over every scheduled request's chunk; returns each one's last hidden state."""
        bs, num_groups = self.block_size, max(group_of_layer) + 1
        n_sched = np.array([len(c) for c in chunks])
        starts = np.concatenate([[0], np.cumsum(n_sched)[:-1]])
        positions = torch.cat([torch.arange(logical[rid], logical[rid] + len(c)) for rid, c in zip(step_ids, chunks)])
        physical = []
        for g in range(num_groups):
            evicted = [plans[rid].num_evicted[g] for rid in step_ids]
            physical.append(positions - torch.from_numpy(np.repeat(evicted, n_sched)))
        # Blocks for the new tokens, and each token's slot per group.
        slots = []
        for g in range(num_groups):
            for rid, s, n in zip(step_ids, starts, n_sched):
                row = runner.requests[rid].block_ids[g]
                while len(row) < cdiv(int(physical[g][s + n - 1]) + 1, bs):
                    row.append(free.pop(0))
            slots.append(torch.tensor([runner.requests[rid].block_ids[g][p // bs] * bs + p % bs
                                       for rid, s, n in zip(step_ids, starts, n_sched)
                                       for p in physical[g][s:s + n].tolist()]))
        step = step_passes(worker, step_ids, starts, n_sched, positions, physical)
        decoding = all(n == 1 for n in n_sched)
        tables, seq_lens = [], []
        for g in range(num_groups):
            rows = [runner.requests[rid].block_ids[g] for rid in step_ids]
            table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
            for i, r in enumerate(rows):
                table[i, :len(r)] = torch.tensor(r)
            tables.append(table.to(self.device))
            lens = [int(physical[g][s + n - 1]) + 1 for s, n in zip(starts, n_sched)]
            # As the plugin edits vLLM's metadata: the kernel attends one key
            # for the rows whose attention the worker's fused op computes.
            for row in step.fused_rows if step is not None else ():
                lens[row] = 1
            seq_lens.append(lens)
        w = self.w
        token_ids = torch.tensor([t for c in chunks for t in c], device=self.device)
        x = F.embedding(token_ids, w["model.embed_tokens.weight"])
        total = len(positions)
        for i, layer in enumerate(worker.layers):
            p, g = f"model.layers.{i}.", group_of_layer[i]
            h = self._norm(x, p + "input_layernorm.weight")
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(total, self.hq, self.d)
            k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(total, self.hkv, self.d)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(total, self.hkv, self.d)
            q, k = self._rope(q, positions), self._rope(k, positions)
            key_view, value_view = split_kv_cache(layer.kv_cache)
            slot = slots[g].to(self.device)
            key_view[slot // bs, slot % bs] = k
            value_view[slot // bs, slot % bs] = v
            out = torch.empty(total, self.hq, self.d, dtype=self.dtype, device=self.device)
            if decoding:
                out[:] = worker.ops.decode_attention_with_scores(
                    q, key_view, value_view, tables[g], torch.tensor(seq_lens[g], device=self.device), self.scale,
                    None, max_seq_len=max(seq_lens[g]))
            else:
                for j, (s, n) in enumerate(zip(starts, n_sched)):
                    keys = worker.ops.gather_dense(key_view, tables[g][j], seq_lens[g][j]).unsqueeze(0)
                    values = worker.ops.gather_dense(value_view, tables[g][j], seq_lens[g][j]).unsqueeze(0)
                    key_slot = torch.arange(seq_lens[g][j], device=self.device)
                    mask = key_slot <= physical[g][s:s + n].to(self.device).unsqueeze(1)
                    qj = q[s:s + n].transpose(0, 1).unsqueeze(0)
                    out[s:s + n] = F.scaled_dot_product_attention(qj, keys, values, attn_mask=mask, scale=self.scale,
                                                                  enable_gqa=True)[0].transpose(0, 1)
            out = out.view(total, -1)
            if step is not None:
                with _no_syncs(check_syncs and self.device.type == "cuda"):
                    step.after_attention(layer.layer_name, q, layer.kv_cache, out)
            x = x + F.linear(out, w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate, up = F.linear(h, w[p + "mlp.gate_proj.weight"]), F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        return x[torch.as_tensor(starts + n_sched - 1, device=self.device)]


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
