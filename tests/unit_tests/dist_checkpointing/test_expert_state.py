"""Expert weights in checkpoints: keyed by global expert index (EP/ETP can change on load),
one main writer per expert shard over ``expt_dp``."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.core.dist_checkpointing import load, save
from megatron.core.dist_checkpointing.model_state import load_model_pieces, model_sharded_state_dict
from megatron.core.dist_checkpointing.validation import ShardRecord
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from tests.unit_tests.dist_checkpointing.test_model_state import _check_one_main_writer_per_chunk, _leaves
from tests.unit_tests.dist_harness import run_distributed

HIDDEN, FFN, NUM_EXPERTS = 4, 6, 4


class _ToyExperts(nn.Module):
    """The MoE layer's expert contract: ``weight1`` [local, hidden, ffn] column-parallel and
    ``weight2`` [local, ffn, hidden] row-parallel over ``expt_tp``; a replicated dense bias."""

    def __init__(self, pg, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        full1, full2 = (
            torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=gen),
            torch.randn(NUM_EXPERTS, FFN, HIDDEN, generator=gen),
        )
        self.num_local_experts = NUM_EXPERTS // pg.size("ep")
        self.local_expert_offset = pg.rank("ep") * self.num_local_experts
        experts = slice(self.local_expert_offset, self.local_expert_offset + self.num_local_experts)
        etp, etp_rank = pg.size("expt_tp"), pg.rank("expt_tp")
        ffn = slice(etp_rank * FFN // etp, (etp_rank + 1) * FFN // etp)
        self.weight1 = nn.Parameter(full1[experts][:, :, ffn].clone())
        self.weight2 = nn.Parameter(full2[experts][:, ffn].clone())
        self.bias = nn.Parameter(torch.randn(HIDDEN, generator=gen))
        for param, dim in ((self.weight1, 2), (self.weight2, 1)):
            param.is_expert, param.tensor_model_parallel, param.partition_dim = True, etp > 1, dim

    def full(self):
        return {"weight1": self.weight1, "weight2": self.weight2, "bias": self.bias}


def _collection(sizes):
    return ProcessGroupCollection.from_layout(RankLayout.for_world(dist.get_world_size(), **sizes))


def _records(sizes):
    pg = _collection(sizes)
    return [ShardRecord.of(leaf) for leaf in _leaves(model_sharded_state_dict(_ToyExperts(pg, seed=1), pg))]


@pytest.mark.parametrize(
    "sizes", [dict(ep=2, etp=1), dict(tp=2, ep=2), dict(ep=4, etp=1)], ids=["EP2xEDP2", "EP2xETP2", "EP4"]
)
def test_one_main_writer_per_expert_shard_under_global_keys(sizes):
    per_rank = run_distributed(_records, 4, sizes)
    records_by_rank = dict(enumerate(per_rank))
    _check_one_main_writer_per_chunk(records_by_rank)  # every element once, one main writer each
    shapes = {(r.key, r.global_shape) for records in per_rank for r in records}
    assert shapes == {
        ("weight1", (NUM_EXPERTS, HIDDEN, FFN)),
        ("weight2", (NUM_EXPERTS, FFN, HIDDEN)),
        ("bias", (HIDDEN,)),
    }


def _save(sizes, path):
    pg = _collection(sizes)
    model = _ToyExperts(pg, seed=1)
    save({"model": model_sharded_state_dict(model, pg)}, path)


def _load(sizes, path):
    pg = _collection(sizes)
    model = _ToyExperts(pg, seed=2)
    load_model_pieces(model, load({"model": model_sharded_state_dict(model, pg)}, path)["model"])
    expected = _ToyExperts(pg, seed=1)  # the saved values of this rank's experts and ETP slice
    return all(torch.equal(p, expected.full()[n]) for n, p in model.full().items())


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ((4, dict(ep=4, etp=1)), (1, {})),
        ((4, dict(ep=4, etp=1)), (4, dict(tp=2, ep=2))),
        ((2, dict(ep=2)), (4, dict(tp=2, ep=1, etp=2))),
    ],
    ids=["EP4->EP1", "EP4->EP2xETP2", "EP2->ETP2xEDP2"],
)
def test_saved_experts_load_at_another_expert_layout(tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    run_distributed(_save, saved[0], saved[1], path)
    assert all(run_distributed(_load, loaded[0], loaded[1], path))


def _expert_dp_save_and_dp_load_share_a_cache(root, cache_dir):
    from megatron.core.dist_checkpointing import AssignmentCache, exchange_utils
    from megatron.core.dist_checkpointing.strategies.fully_parallel import pieces_to_read, pieces_to_write

    pg = _collection(dict(ep=2, etp=1))
    model = _ToyExperts(pg, seed=1)
    records = [ShardRecord.of(leaf) for leaf in _leaves(model_sharded_state_dict(model, pg))]
    save_group, load_group = pg.expt_dp, pg.dp_cp
    uncached = (pieces_to_write(records, save_group, None), pieces_to_read(records, load_group, None)[0])
    cache = AssignmentCache(cache_dir)
    exchange_utils.GATHER_COUNTS.clear()
    elected = []
    for step in (1, 2):  # step 2 reads every assignment back from the cache
        path = f"{root}/step{step}"
        save(
            {"model": model_sharded_state_dict(model, pg)},
            path,
            parallelization_group=save_group,
            assignment_cache=cache,
        )
        dist.barrier()
        cache.clear_memory()  # the next lookups go to the shared directory
        elected.append((pieces_to_write(records, save_group, cache), pieces_to_read(records, load_group, cache)[0]))
        fresh = _ToyExperts(pg, seed=2)
        loaded = load(
            {"model": model_sharded_state_dict(fresh, pg)},
            path,
            parallelization_group=load_group,
            assignment_cache=cache,
        )
        load_model_pieces(fresh, loaded["model"])
        assert all(torch.equal(p, model.full()[n]) for n, p in fresh.full().items()), f"step {step} load differs"
    members = (tuple(dist.get_process_group_ranks(save_group)), tuple(dist.get_process_group_ranks(load_group)))
    return uncached, elected, dict(exchange_utils.GATHER_COUNTS), members


def test_expert_dp_save_and_dp_load_with_one_cache_directory_elect_the_uncached_writers(tmp_path):
    results = run_distributed(
        _expert_dp_save_and_dp_load_share_a_cache, 4, str(tmp_path / "ckpt"), str(tmp_path / "cache")
    )
    for uncached, elected, gathers, (save_members, load_members) in results:
        assert save_members in ((0, 2), (1, 3)) and load_members == (0, 1, 2, 3)
        assert all(e == uncached for e in elected)
        # one gather per group identity and purpose; every later lookup hit the cache
        assert gathers == {save_members: 1, load_members: 1}
    writers = {}
    for rank, (uncached, *_) in enumerate(results):
        for chunk in uncached[0]:
            writers.setdefault(chunk, []).append(rank)
    assert all(len(ranks) == 1 for ranks in writers.values())  # one writer per piece
    expert_chunks = [c for c in writers if c[1] in ("weight1", "weight2")]
    assert len(expert_chunks) == 4  # two EP shards of each expert weight, each written once
