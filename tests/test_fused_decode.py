"""Fused decode attention: the metadata edits that let vLLM's kernel attend one key
for a fused row (CPU_ATTN, the same code as FLASH_ATTN).

A decode query that a plain-softmax scorer observes (H2O, TOVA, R-KV) gets
its attention and its scores from one op (`decode_attention_with_scores`).
In the real engine (its compiled engine is shared):
tests/test_eviction_equality.py::test_fused_decode_rows_equal_reference_and_skip_vllms_pass.
"""

from __future__ import annotations

import pytest
import torch

from vllm_kvcompress.vllm_seam.worker import step_inputs


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
