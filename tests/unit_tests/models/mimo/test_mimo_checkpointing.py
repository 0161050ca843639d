"""Sharded MIMO checkpoints: every module is described through its own process groups (one
main writer per chunk, GTP offsets and replica ids from the module's own groups, each chained
optimizer's keys apart), saved over the whole job and loaded back exactly; no global
process-group lookup happens on the way; train_mimo resumes a run exactly, also when the
encoder and the language model live on disjoint ranks."""

import dataclasses
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.config import TransformerConfig
from megatron.core.dist_checkpointing import (
    CheckpointingError,
    load_latest,
    save_iteration,
    validate_records,
    write_latest_iteration,
)
from megatron.core.dist_checkpointing.dict_utils import iter_leaves
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.dist_checkpointing.validation import ShardRecord
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.hybrid import HybridModel, get_hybrid_stack_local_spec
from megatron.core.models.mimo import (
    LANGUAGE_MODEL,
    MimoRoles,
    build_bridges,
    build_mimo_model,
    forward_backward,
    get_mimo_optimizer,
    image_submodule_provider,
    module_parts,
    wrap_with_ddp,
)
from megatron.core.models.mimo.checkpointing import load_mimo_state, mimo_sharded_state_dict
from megatron.core.optimizer import OptimizerConfig
from megatron.core.tensor_parallel.sharding import gather_full_tensor
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.models.mimo.test_train_mimo import ARGV, load_script
from tests.unit_tests.models.mimo.tiny import (
    IMAGE,
    IMAGE_TOKEN,
    LM_HIDDEN,
    NUM_IMAGE_TOKENS,
    PATCH,
    SEQ,
    VOCAB,
    dataset,
    encoder_config,
    iterators,
)
from tests.unit_tests.training.loss_curve import losses_by_iteration

HYBRID_PATTERN = "M*"


def forbid_global_groups() -> None:
    """Make every fallback to the global process groups fail on this rank."""

    def refuse():
        raise AssertionError("a global process-group lookup happened although explicit collections were given")

    parallel_state.get_process_group_collection = refuse


def hybrid_language_model(seed: int):
    """Provider of a Mamba + attention language model; Mamba: 8 heads of 8, 2 groups, state 8, so
    in_proj packs [z 64, x 64, B 16, C 16, dt 8]."""

    def provide(pg):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=LM_HIDDEN,
            num_attention_heads=4,
            ffn_hidden_size=64,
            normalization="RMSNorm",
            add_bias_linear=False,
            mamba_head_dim=8,
            mamba_state_dim=8,
            mamba_num_groups=2,
            tensor_model_parallel_size=pg.size("tp"),
            generalized_tensor_parallel_size=pg.size("gtp"),
            init_seed=seed,
        )
        return HybridModel(
            config, get_hybrid_stack_local_spec(), VOCAB, SEQ, hybrid_layer_pattern=HYBRID_PATTERN, pg_collection=pg
        )

    return provide


def build_job(roles: MimoRoles, collections: dict, seed: int):
    """This rank's MIMO model (hybrid language model, ViT), DDP modules, optimizer chain, bridges."""
    enc = roles.layouts["images"]
    encoder_cfg = dataclasses.replace(encoder_config(enc.tp, enc.gtp), init_seed=seed + 1)
    model = build_mimo_model(
        collections,
        hybrid_language_model(seed),
        {"images": image_submodule_provider(encoder_cfg, IMAGE, PATCH, LM_HIDDEN)},
        {"images": IMAGE_TOKEN},
    )
    ddp = wrap_with_ddp(model, collections, DistributedDataParallelConfig())
    optimizer = get_mimo_optimizer(OptimizerConfig(lr=1e-2), ddp, collections, [LANGUAGE_MODEL, *roles.modality_names])
    bridges = build_bridges(roles, 2, {"images": (NUM_IMAGE_TOKENS, LM_HIDDEN)})
    return model, ddp, optimizer, bridges


def train_step(roles, collections, model, ddp, optimizer, bridges) -> None:
    """One optimizer step on one micro-batch (so the optimizer has state to save)."""
    lm_iter, image_iters = iterators(roles, collections, bridges, dataset())
    for module in ddp.values():
        module.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward(model, bridges, lm_iter, image_iters, 1)
    for name, module in ddp.items():
        finalize_model_grads([module], collections[name], module.config)
    assert optimizer.step()[0]


def full_tensor(local: torch.Tensor, param, part, pg) -> torch.Tensor:
    """The full tensor of which ``local`` is this rank's piece, laid out like ``param`` of
    ``part``, without the vocabulary padding (which checkpoints do not keep)."""
    tensor = gather_full_tensor(local, param, pg).clone()  # unsharded, it would alias the live tensor
    return tensor[:VOCAB] if tensor.shape[0] == getattr(part, "padded_vocab_size", None) else tensor


def full_weights(model, collections) -> dict:
    """``{"<module>.<param>": full weight}`` of the modules this rank holds."""
    return {
        f"{name}.{pname}": full_tensor(param, param, part, collections[name])
        for name, part in module_parts(model).items()
        for pname, param in part.named_parameters()
    }


def snapshot(model, optimizer, collections) -> dict:
    """Every full weight, fp32 master and optimizer state tensor, and every param-group value,
    of the modules this rank holds."""
    out = {f"weight:{key}": value for key, value in full_weights(model, collections).items()}
    for name, part in module_parts(model).items():
        names = {id(p): pname for pname, p in part.named_parameters()}
        member = optimizer.optimizers[name]
        for entry in member.master_params:
            param, pg = entry.model_param, collections[name]
            where = f"{name}.{names[id(param)]}"
            out[f"master:{where}"] = full_tensor(entry.master, param, part, pg)
            for state_name, value in member.optimizer.state[entry.master].items():
                is_step = state_name == "step"
                out[f"{state_name}:{where}"] = value.clone() if is_step else full_tensor(value, param, part, pg)
        for index, group in enumerate(member.optimizer.param_groups):
            out.update({f"group:{name}.{index}.{k}": v for k, v in group.items() if k != "params"})
    return out


def assert_snapshots_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def leaves(state: dict) -> list:
    built, _ = apply_factories(state)
    return [leaf for _, leaf in iter_leaves(built) if isinstance(leaf, (ShardedTensor, ShardedObject))]


def records(state: dict) -> list[ShardRecord]:
    return [ShardRecord.of(leaf) for leaf in leaves(state)]


# ------------------------------------------------------------------ TP2 x GTP2 language model


def _gtp_job_round_trip(root):
    """Language model TP2xGTP2xDP1, encoder TP1xGTP2xDP2 on the same 4 ranks: train one step,
    save, load into a differently seeded job; no global lookup anywhere."""
    forbid_global_groups()
    roles = MimoRoles.build(4, language={"tp": 2, "gtp": 2}, modalities={"images": {"gtp": 2}})
    collections = roles.build_collections()
    job = build_job(roles, collections, seed=11)
    train_step(roles, collections, *job)
    model, _, optimizer, _ = job
    state = mimo_sharded_state_dict(model, collections, optimizer)
    saved = snapshot(model, optimizer, collections)
    coords = {name: {axis: pg.rank(axis) for axis in ("tp", "gtp", "dp")} for name, pg in collections.items()}
    pieces = {r.key: (r.global_offset, r.local_shape, r.replica_id) for r in records(state)}
    save_iteration(state, root, 1)  # validates the combined sharding of all ranks first

    fresh, _, fresh_optimizer, _ = build_job(roles, collections, seed=99)
    before = snapshot(fresh, fresh_optimizer, collections)
    loaded, iteration = load_latest(mimo_sharded_state_dict(fresh, collections, fresh_optimizer), root)
    load_mimo_state(fresh, loaded, fresh_optimizer)
    return records(state), coords, pieces, saved, before, snapshot(fresh, fresh_optimizer, collections), iteration


def test_tp2_gtp2_language_model_checkpoints_through_its_own_groups(tmp_path):
    results = run_distributed(_gtp_job_round_trip, 4, str(tmp_path))
    per_rank = {rank: result[0] for rank, result in enumerate(results)}
    validate_records(per_rank)
    mains = defaultdict(list)
    for rank, recs in per_rank.items():
        for record in recs:
            if record.is_main and record.numel:
                mains[record.chunk].append(rank)
    every_chunk = {record.chunk for recs in per_rank.values() for record in recs}
    assert {chunk for chunk, ranks in mains.items() if len(ranks) == 1} == every_chunk
    keys = {record.key for recs in per_rank.values() for record in recs}
    for module in (LANGUAGE_MODEL, "images"):  # each chained member's singletons under its own keys
        assert {f"optimizer.{module}.param_groups", f"optimizer.{module}.format"} <= keys
    assert "language_model.decoder.layers.0.mixer.A_log" in keys
    assert "modality_submodules.images.encoder.patch_embedding.weight" in keys
    assert "modality_submodules.images.projection.linear_fc1.weight" in keys
    assert "optimizer.images.state.exp_avg.modality_submodules.images.projection.linear_fc2.weight" in keys

    for _, coords, pieces, *_ in results:
        t, g = coords[LANGUAGE_MODEL]["tp"], coords[LANGUAGE_MODEL]["gtp"]  # language model: dp 0
        lm = "language_model.decoder.layers.0.mixer."
        # in_proj: 84 TP-local rows [z 32, x 32, B 8, C 8, dt 4], 42 per GTP peer; GTP-sharded: dp_cp replica id
        assert pieces.get(lm + "in_proj.weight.part0") == (((32 * t, 0), (32, 32), (0, 0, 0)), None)[g]
        assert (
            pieces[lm + "in_proj.weight.part1"]
            == (((32 * t, 0), (10, 32), (0, 0, 0)), ((32 * t + 10, 0), (22, 32), (0, 0, 0)))[g]
        )
        assert pieces[lm + "out_proj.weight"][::2] == ((16 * g, 32 * t), (0, 0, 0))  # row-parallel: GTP on dim 0
        for replicated in ("A_log", "D", "dt_bias", "conv1d_weight.part0", "conv1d_bias.part1", "norm.weight"):
            assert pieces[lm + replicated][2] == (0, g, 0), replicated  # TP-sharded, whole on GTP peers
        assert pieces["language_model.decoder.final_layernorm.weight"][2] == (t, g, 0)
        # vocabulary padded to 512 rows: 256 per TP rank, 128 per GTP peer; only the true rows are saved
        first = 256 * t + 128 * g
        true_rows = min(128, VOCAB - first)
        expected = ((first, 0), (true_rows, 32), (0, 0, 0)) if true_rows > 0 else None
        assert pieces.get("language_model.embedding.word_embeddings.weight") == expected
        assert pieces["optimizer.language_model.param_groups"][2] == (t, 0, 0, g)  # tp, pp, dp, gtp

        g, d = coords["images"]["gtp"], coords["images"]["dp"]  # encoder: tp 0
        enc = "modality_submodules.images."
        assert pieces[enc + "encoder.patch_embedding.weight"][::2] == ((8 * g, 0), (0, 0, d))
        assert pieces[enc + "projection.linear_fc2.weight"][::2] == ((16 * g, 0), (0, 0, d))
        assert pieces[enc + "projection.linear_fc2.bias"][2] == (0, g, d)
        assert pieces[enc + "encoder.position_embeddings"][2] == (0, g, d)
        assert pieces["optimizer.images.param_groups"][2] == (0, 0, d, g)
    for _, _, _, saved, before, after, iteration in results:
        assert iteration == 1
        assert not torch.equal(
            before["weight:language_model.embedding.word_embeddings.weight"],
            saved["weight:language_model.embedding.word_embeddings.weight"],
        )
        assert_snapshots_equal(after, saved)


# ------------------------------------------------------------------ GTP of size one, or none


def _records_with_and_without_gtp():
    """Records of a trained job (language model TP2, encoder DP2, 2 ranks) described through
    size-one GTP collections and through the same collections without any GTP group."""
    forbid_global_groups()
    roles = MimoRoles.build(2, language={"tp": 2}, modalities={"images": {}})
    with_gtp = roles.build_collections()
    without_gtp = {name: pg.replace(gtp=None, dp_cp_gtp=None) for name, pg in with_gtp.items()}
    out = {}
    for label, collections in (("size-one gtp", with_gtp), ("no gtp", without_gtp)):
        job = build_job(roles, collections, seed=3)
        train_step(roles, collections, *job)
        out[label] = records(mimo_sharded_state_dict(job[0], collections, job[2]))
    coords = {name: (pg.rank("tp"), pg.rank("pp"), pg.rank("dp")) for name, pg in with_gtp.items()}
    return out, coords


def test_size_one_and_absent_gtp_keep_the_plain_tp_pp_dp_election():
    results = run_distributed(_records_with_and_without_gtp, 2)
    for out, coords in results:
        assert out["no gtp"] == out["size-one gtp"]
        singletons = [r for r in out["no gtp"] if r.kind == "object"]
        assert {r.key for r in singletons} == {
            f"optimizer.{m}.{k}" for m in (LANGUAGE_MODEL, "images") for k in ("param_groups", "format")
        }
        for record in singletons:
            assert record.replica_id == coords[record.key.split(".")[1]]  # (tp, pp, dp), nothing appended
        for record in out["no gtp"]:
            if record.kind == "tensor":
                assert record.replica_id[1] == 0  # the gtp slot of a tensor's id stays 0
    for label in ("size-one gtp", "no gtp"):
        per_rank = {rank: out[label] for rank, (out, _) in enumerate(results)}
        validate_records(per_rank)


# ------------------------------------------------------------------ train_mimo: disjoint ranks, resume


def _trainer(script, argv):
    """What ``train_mimo.train`` does, keeping the trainer: build, resume when --load, train."""
    trainer = script.MimoTrainer(script.parse_mimo_args(argv))
    if trainer.args.load:
        trainer.load()
    trainer.train()
    trainer.logger.close()
    return trainer


def _disjoint_train_save_resume(straight_dir, resumed_dir):
    """Encoder on ranks 0-1 (DP2), language model TP2xDP2 on ranks 2-5, distributed optimizer
    and dropout: 4 straight iterations saving at 2 and 4; a run resumed from 2; fresh
    differently seeded modules loading the final checkpoint."""
    forbid_global_groups()
    script = load_script()
    flags = ARGV + [
        "--tensor-model-parallel-size",
        "2",
        "--encoder-ranks",
        "first-2",
        "--train-iters",
        "4",
        "--hidden-dropout",
        "0.1",
        "--use-distributed-optimizer",
        "--lr-warmup-iters",
        "1",
    ]
    metrics = ["--log-interval", "1", "--metrics-jsonl"]
    straight_metrics, resumed_metrics = straight_dir + ".jsonl", resumed_dir + ".jsonl"
    straight = _trainer(script, flags + ["--save", straight_dir, "--save-interval", "2", *metrics, straight_metrics])
    if dist.get_rank() == 0:
        write_latest_iteration(straight_dir, 2)
    dist.barrier()
    resumed = _trainer(script, flags + ["--load", straight_dir, "--save", resumed_dir, *metrics, resumed_metrics])
    fresh = script.MimoTrainer(script.parse_mimo_args(flags + ["--seed", "5", "--load", resumed_dir, "--finetune"]))
    before = full_weights(fresh.model, fresh.collections)
    fresh.load()
    weights = [full_weights(t.model, t.collections) for t in (straight, resumed, fresh)]
    resumed_state = dataclasses.asdict(resumed.state)  # a plain dict: the parent cannot import train_mimo's class
    return resumed_state, sorted(module_parts(straight.model)), before, *weights


def test_disjoint_layout_resumes_exactly_and_loads_into_fresh_modules(tmp_path):
    results = run_distributed(_disjoint_train_save_resume, 6, str(tmp_path / "straight"), str(tmp_path / "resumed"))
    straight = losses_by_iteration(tmp_path / "straight.jsonl")
    assert sorted(straight) == [1, 2, 3, 4] and straight[4] < straight[1]
    # resumed at iteration 3 (1 and 2 came from the checkpoint): the same losses, bit for bit
    assert losses_by_iteration(tmp_path / "resumed.jsonl") == {3: straight[3], 4: straight[4]}
    for rank, (resumed, modules, before, trained, resumed_weights, loaded) in enumerate(results):
        assert modules == (["images"] if rank < 2 else [LANGUAGE_MODEL])
        assert (resumed["iteration"], resumed["consumed_samples"]) == (4, 32)
        for name, weight in trained.items():
            assert torch.equal(resumed_weights[name], weight), name
            assert torch.equal(loaded[name], weight), name
        assert any(not torch.equal(before[name], weight) for name, weight in trained.items())


# ------------------------------------------------------------------ bad inputs


def _mismatched_modules():
    roles = MimoRoles.build(1, language={}, modalities={"images": {}})
    collections = roles.build_collections()
    model, _, optimizer, _ = build_job(roles, collections, seed=3)
    errors = []
    for call in (
        lambda: mimo_sharded_state_dict(model, {LANGUAGE_MODEL: collections[LANGUAGE_MODEL]}),
        lambda: load_mimo_state(model, {"model": {"images": {}}}),
    ):
        with pytest.raises(CheckpointingError) as error:
            call()
        errors.append(str(error.value))
    return errors


def test_modules_without_collections_or_loaded_state_are_named():
    (errors,) = run_distributed(_mismatched_modules, 1)
    assert errors == [
        "this rank holds modules ['images', 'language_model'] but collections covers ['language_model']; "
        "give one entry per held module",
        "this rank holds modules ['images', 'language_model'] but the loaded model state covers ['images']; "
        "every held module needs an entry",
    ]
