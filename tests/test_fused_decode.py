"""Fused decode attention in the real engine (CPU_ATTN, the same code as FLASH_ATTN).

A decode query that a plain-softmax scorer observes (H2O, TOVA, R-KV) gets
its attention and its scores from one op (`decode_attention_with_scores`):
vLLM's kernel attends one key for that row (the plugin's metadata edit) and
the worker writes the row. Requests of every kind share the batch; each must
equal the reference decoder, and the fused path must have carried the
decode steps of the plain-softmax scorers, and only theirs.
"""

from __future__ import annotations

import pytest
import torch

from helpers import engine_kwargs, in_process_engine, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.vllm_seam.worker import attention_passes, step_inputs

NEW_TOKENS = 24
CONFIGS = [
    {"policy": "h2o", "budget": 48, "interval": 8},
    {"policy": "tova", "budget": 40, "interval": 4},
    {"policy": "rkv", "budget": 12, "interval": 8},
    {"policy": "keyformer", "budget": 48, "interval": 8},  # noisy logits: scored in a separate pass
    {"policy": "snapkv", "budget": 48},  # observes its prompt only
    None,
]
FUSED = {"h2o", "tova", "rkv"}


def test_fused_decode_rows_equal_reference_and_skip_vllms_pass(tiny_model, monkeypatch):
    from kvc_tools.reference_decoder import ReferenceDecoder

    fused_policies: list[str] = []
    edited: list[tuple[list[int], list[int]]] = []  # (fused rows, their seq_lens in vLLM's metadata)
    attend_fused, apply = attention_passes.FusedDecode.run, step_inputs.MetadataEdits.apply

    def counting(self, layer, *args):
        fused_policies.extend(r.state.plan.scorer.name for r in self.step.fused)
        return attend_fused(self, layer, *args)

    def recording(self, cm, vllm_group):
        out = apply(self, cm, vllm_group)
        if len(self.fused_rows):
            edited.append((self.fused_rows.tolist(), out.seq_lens[self.fused_rows].tolist()))
        return out

    monkeypatch.setattr(attention_passes.FusedDecode, "run", counting)
    monkeypatch.setattr(step_inputs.MetadataEdits, "apply", recording)
    prompts = random_prompts((150, 120, 90, 140, 110, 60), seed=5)
    # Compiled, as vLLM runs by default: the hooks inside the attention op still run every step.
    with in_process_engine(**engine_kwargs(tiny_model, kv_compress="none", enforce_eager=False)) as engine:
        got = engine.generate(prompts, NEW_TOKENS, CONFIGS)
    reference = ReferenceDecoder(tiny_model)
    for prompt, config, tokens in zip(prompts, CONFIGS, got):
        cfg = KVCompressConfig.from_dict(config) if config else None
        assert tokens == reference.generate(prompt, NEW_TOKENS, cfg, block_size=32)["tokens"], config
    assert set(fused_policies) == FUSED
    assert edited and all(lens == [1] * len(rows) for rows, lens in edited)


def test_metadata_edits_shorten_fused_rows_in_compressed_groups_only():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens = torch.tensor([100, 7, 50, 80], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 5, 6, 7]), query_start_loc_cpu=torch.tensor([0, 1, 5, 6, 7]),
        seq_lens=seq_lens, num_reqs=4, num_actual_tokens=7, max_query_len=4, max_seq_len=100,
        block_table_tensor=torch.zeros(4, 4, dtype=torch.int32), slot_mapping=torch.zeros(7, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone())
    rows = torch.tensor([0, 3])
    edits = step_inputs.MetadataEdits(4, {1: torch.tensor([0, 0, -30, 10], dtype=torch.int32)}, rows, rows,
                                 frozenset({0, 1}))
    group0, group1, sliding = edits.apply(cm, 0), edits.apply(cm, 1), edits.apply(cm, 2)
    assert group0.seq_lens.tolist() == [1, 7, 50, 1] and group0.max_seq_len == 100
    assert group0.seq_lens_cpu_upper_bound.tolist() == [1, 7, 50, 1]
    # Group 1 is 30 longer for request 2: the bound grows with it.
    assert group1.seq_lens.tolist() == [1, 7, 80, 1] and group1.max_seq_len == 100
    assert sliding is cm and cm.seq_lens.tolist() == [100, 7, 50, 80]  # shared metadata untouched
    edits = step_inputs.MetadataEdits(4, {1: torch.tensor([0, 0, -60, 0], dtype=torch.int32)}, rows[:0], rows[:0],
                                 frozenset({0, 1}))
    assert edits.apply(cm, 1).max_seq_len == 110 and edits.apply(cm, 0) is cm
    with pytest.raises(RuntimeError, match="metadata for 4 requests, step planned 3"):
        step_inputs.MetadataEdits(3, {}, rows, rows, frozenset({0})).apply(cm, 0)
