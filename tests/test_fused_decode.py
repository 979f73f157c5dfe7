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


def test_model_runner_v2_edits_every_compressed_group_from_the_logical_lengths():
    """MRV2's seq_lens stay logical (its sampler reads them): every compressed
    group, group 0 included, gets its physical lengths as an absolute edit,
    from the runner view's offsets; V1's takes group 0's in place."""
    import numpy as np
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_kvcompress.vllm_seam.worker.runner_view import MRV2View

    logical = torch.tensor([300, 7, 120], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2, 3]), query_start_loc_cpu=torch.tensor([0, 1, 2, 3]),
        seq_lens=logical, num_reqs=3, num_actual_tokens=3, max_query_len=1, max_seq_len=300,
        block_table_tensor=torch.zeros(3, 10, dtype=torch.int32), slot_mapping=torch.zeros(3, dtype=torch.int64),
        seq_lens_cpu_upper_bound=logical.clone())
    # vLLM groups: 0 sliding (hybrid, never evicts), 1 and 2 compressed.
    offsets = np.array([[0, 200, 250], [0, 0, 0], [0, 64, 0]])
    deltas = MRV2View(runner=None).seq_len_deltas(offsets)
    assert sorted(deltas) == [1, 2]
    none = torch.tensor([], dtype=torch.int64)
    edits = step_inputs.MetadataEdits(3, deltas, none, none, frozenset({1, 2}))
    assert edits.apply(cm, 0) is cm
    assert edits.apply(cm, 1).seq_lens.tolist() == [100, 7, 56]
    assert edits.apply(cm, 2).seq_lens.tolist() == [50, 7, 120]
    assert edits.apply(cm, 2).seq_lens_cpu_upper_bound.tolist() == [50, 7, 120]
    assert edits.apply(cm, 1).max_seq_len == 300  # an upper bound still
    assert cm.seq_lens.tolist() == [300, 7, 120]  # the sampler's lengths untouched
