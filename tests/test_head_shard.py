"""Cross-head decisions on two tensor-parallel ranks (gloo, two processes, no vLLM).

Under tensor parallelism each rank holds some of a layer's heads; what a
composition decides across heads gathers the others first, on the cache's
device (vLLM's device communicator takes device tensors only). Two ranks each
hold half the heads of a batch of requests and run the per-head allocation's
batched selection (AdaKV's shared top-k) and TOVA's score; every gathered
tensor must be on the cache's device, and each rank's result must be its
heads' slice of the one-device result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_kvcompress.budgets import LayerToSelect, PerHead
from vllm_kvcompress.scorers.base import Observation
from vllm_kvcompress.scorers.tova import TOVA
from vllm_kvcompress.selection import TOP
from vllm_kvcompress.sharding import ONE_DEVICE, HeadShard

WORLD = 2
KV_HEADS, GROUP = 4, 2  # over both ranks
LENGTHS = (30, 17, 24)


def inputs():
    """Each request's scores and positions [Hkv, T], and attention [Hq, T] (all heads)."""
    gen = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 5, (KV_HEADS, n), generator=gen).float(),
             torch.stack([torch.randperm(n, generator=gen) for _ in range(KV_HEADS)]),
             torch.rand(KV_HEADS * GROUP, n, generator=gen)) for n in LENGTHS]


def decide(shard: HeadShard, heads: slice, device: torch.device):
    """AdaKV's selection of every request and TOVA's scores, on `heads`."""
    rows = [LayerToSelect(scores[heads].to(device), positions[heads].to(device), slots=12, layer_budget=10,
                          budget=10, protected=lambda b: (1, 2), selection=TOP, shard=shard)
            for scores, positions, _ in inputs()]
    selected = PerHead(alpha=0.3).select_batch(rows)
    q_heads = slice(heads.start * GROUP, heads.stop * GROUP)
    tova = [TOVA().score(Observation(attention=attention[q_heads].to(device), positions=positions[heads][:1].expand(
        heads.stop - heads.start, -1).to(device), num_kv_heads=heads.stop - heads.start, layer=0,
        num_compressions=0, shard=shard)) for _, positions, attention in inputs()]
    return ([(s.keep_idx.cpu(), s.dead.cpu()) for s in selected], [t.cpu() for t in tova])


def rank_main(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    device = torch.device("cpu")  # the cache's device here
    devices = []

    def gather(local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(WORLD)]
        dist.all_gather(parts, local.contiguous())
        devices.extend([local.device, parts[0].device])
        return torch.cat(parts, 0)

    per_rank = KV_HEADS // WORLD
    result = decide(HeadShard(rank, WORLD, gather), slice(rank * per_rank, (rank + 1) * per_rank), device)
    torch.save({"result": result, "devices": [str(d) for d in devices]}, out.format(rank))
    dist.destroy_process_group()


def test_cross_head_gathers_on_two_ranks_stay_on_the_cache_device(tmp_path):
    out = str(tmp_path / "rank{}.pt")
    mp.spawn(rank_main, args=(str(tmp_path / "init"), out), nprocs=WORLD, join=True)
    (want_selected, want_tova) = decide(ONE_DEVICE, slice(0, KV_HEADS), torch.device("cpu"))
    per_rank = KV_HEADS // WORLD
    for rank in range(WORLD):
        saved = torch.load(out.format(rank))
        heads = slice(rank * per_rank, (rank + 1) * per_rank)
        assert saved["devices"] and set(saved["devices"]) == {"cpu"}  # the cache's device, gathered there
        got_selected, got_tova = saved["result"]
        for (keep, dead), (want_keep, want_dead) in zip(got_selected, want_selected):
            assert torch.equal(keep, want_keep[heads]) and torch.equal(dead, want_dead[heads])
        for got, want in zip(got_tova, want_tova):
            assert torch.equal(got, want[heads])
