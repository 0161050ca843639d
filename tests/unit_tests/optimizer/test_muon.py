"""Muon (--optimizer muon): Newton-Schulz keeps a matrix's singular vectors and pulls its
singular values towards 1; one step by hand (weight decay, EMA momentum, Nesterov, Q/K/V split,
scale); which weights Muon steps; and training through the real loop: TP2, DP2 with the
distributed optimizer and EP2 give the single-process curve (blockwise TP does not), and a
checkpoint resumes exactly under another layout."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, OptimizerConfigError, get_megatron_optimizer
from megatron.core.optimizer.muon import Muon, MuonMatrix, newton_schulz, ns_coefficients, scale_factor
from megatron.training.arguments import ArgumentError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny


@pytest.mark.parametrize("shape", [(12, 5), (5, 12)])
def test_newton_schulz_keeps_singular_vectors_and_pulls_singular_values_to_one(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    out = newton_schulz(g, ns_coefficients("quintic", 5), low_precision=False).double()
    core = u.T @ out @ vh.T  # diagonal when the singular vectors are kept
    off_diagonal = core - torch.diag(torch.diagonal(core))
    assert off_diagonal.abs().max() < 1e-5
    assert ((torch.diagonal(core) > 0.6) & (torch.diagonal(core) < 1.3)).all()  # quintic: noisy around 1
    batched = newton_schulz(torch.stack([g, 2 * g]), ns_coefficients("quintic", 5), low_precision=False)
    torch.testing.assert_close(batched[0], batched[1], rtol=1e-5, atol=1e-6)  # scale-free, per matrix


def test_coefficient_step_rules_and_scales():
    assert len(ns_coefficients("simple", 3)) == 3 and len(ns_coefficients("quintic", 10)) == 10
    assert ns_coefficients("polar_express", 10)[-1] == ns_coefficients("polar_express", 8)[-1]
    with pytest.raises(ValueError, match=r"muon_num_ns_steps \(4\) must be a multiple of 5 for quintic"):
        ns_coefficients("quintic", 4)
    with pytest.raises(ValueError, match=r"must be >= 8 for polar_express"):
        ns_coefficients("polar_express", 5)
    assert scale_factor(8, 2, "spectral") == pytest.approx(8**0.5)
    assert scale_factor(2, 8, "unit_rms_norm") == pytest.approx(0.5)
    assert scale_factor(2, 8, "shape_scaling") == 1.0 and scale_factor(8, 2, "shape_scaling") == pytest.approx(2.0)
    with pytest.raises(OptimizerConfigError, match="muon_num_ns_steps"):
        OptimizerConfig(optimizer="muon", lr=1.0, muon_num_ns_steps=3)


@pytest.mark.parametrize("nesterov", [False, True])
def test_two_steps_by_hand_with_a_split_matrix(nesterov):
    config = OptimizerConfig(
        optimizer="muon", lr=0.1, weight_decay=0.5, muon_momentum=0.8, muon_nesterov=nesterov,
        muon_fp32_matmul_prec="high", muon_extra_scale_factor=0.3,
    )  # fmt: skip
    w0 = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    master = w0.clone()
    matrix = MuonMatrix(torch.nn.Parameter(w0.clone()), split_rows=[2, 4])
    opt = Muon([master], {id(master): (matrix, None, None)}, [], config)
    coefficients = ns_coefficients("quintic", 5)
    want, momentum = w0.clone(), torch.zeros(6, 4)
    for seed in (2, 3):
        grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        master.grad = grad
        opt.step()
        want = want * (1 - 0.1 * 0.5)
        momentum = 0.8 * momentum + 0.2 * grad
        direction = grad + 0.8 * (momentum - grad) if nesterov else momentum
        parts = [direction[:2], direction[2:]]
        update = torch.cat([newton_schulz(p, coefficients, False) * scale_factor(*p.shape, "spectral") for p in parts])
        want = want - 0.1 * 0.3 * update
        torch.testing.assert_close(master, want, rtol=1e-5, atol=1e-6)


def _chain_members():
    pgc = parallel_state.initialize_model_parallel()
    args = tiny_args(["--num-layers", "1", "--swiglu", "--untie-embeddings-and-output-weights", "--train-iters", "1"])
    from megatron.core.models.model_record import model_from_record
    from megatron.training.arguments import model_record_from_args

    model = model_from_record(model_record_from_args(args, 64), pgc)
    chain = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=1e-3), [model], pgc)
    names = {id(p): name for name, p in model.named_parameters()}
    assert isinstance(chain, ChainedOptimizer)
    return [
        (member.config.optimizer, sorted(names[id(e.model_param)] for e in member.master_params))
        for member in chain.chained_optimizers
    ]


def test_muon_steps_the_weight_matrices_and_adam_the_rest():
    ((muon, adam),) = run_distributed(_chain_members, 1)
    layers = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    # as in Megatron, only the word embeddings and the output layer among the 2-D weights go to AdamW
    want = sorted([f"decoder.layers.0.{name}.weight" for name in layers] + ["embedding.position_embeddings.weight"])
    assert muon == ("muon", want)
    assert adam[0] == "adam"
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"} <= set(adam[1])


# Muon from the first update (no warm-up), Newton-Schulz in fp32 so that layouts compare closely.
MUON = [*CURVE_RUN, "--lr-warmup-iters", "0", "--num-layers", "2", "--eval-iters", "0", "--log-interval", "1"]
MUON += ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high", "--swiglu", "--num-query-groups", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.0"]


def _curve(flags, world_size, path):
    run_distributed(train_tiny, world_size, MUON + flags, "gpt", world_size, path)
    return loss_curve(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _curve(["--train-iters", "4"], 1, tmp_path_factory.mktemp("muon") / "single.jsonl")


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2"],
        ["--use-distributed-optimizer"],
        ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-param-gather"],
    ],
    ids=["tp2", "dp2-distributed-optimizer", "tp2-distributed-optimizer-overlap"],
)
def test_layouts_train_the_single_process_curve(reference, layout, tmp_path):
    assert _curve(["--train-iters", "4"] + layout, 2, tmp_path / "m.jsonl") == pytest.approx(reference, rel=1e-5)
    assert reference[-1] < reference[0]


def test_blockwise_tensor_parallelism_is_another_update(reference, tmp_path):
    blockwise = ["--train-iters", "4", "--tensor-model-parallel-size", "2", "--muon-tp-mode", "blockwise"]
    curve = _curve(blockwise, 2, tmp_path / "m.jsonl")
    assert curve[0] == pytest.approx(reference[0], rel=1e-6)  # the first update shows from iteration 2 on
    assert curve[1] != pytest.approx(reference[1], rel=1e-5)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    return _curve(["--train-iters", "3"] + MOE, 1, tmp_path_factory.mktemp("moe") / "single.jsonl")


@pytest.mark.parametrize(
    "layout",
    [["--expert-model-parallel-size", "2", "--use-distributed-optimizer"], ["--tensor-model-parallel-size", "2"]],
    ids=["ep2-distributed-optimizer", "tp2-etp2"],
)
def test_expert_layouts_train_the_single_process_curve(moe_reference, layout, tmp_path):
    """Each expert is its own matrix; under ETP2 its shards are gathered like a dense weight's."""
    assert _curve(["--train-iters", "3"] + MOE + layout, 2, tmp_path / "m.jsonl") == pytest.approx(
        moe_reference, rel=1e-5
    )


def test_resume_under_another_layout_continues_the_curve(reference, tmp_path):
    save = str(tmp_path / "ckpt")
    _curve(["--train-iters", "2", "--lr-decay-iters", "4", "--save", save, "--save-interval", "2"], 1, tmp_path / "a")
    resumed = ["--train-iters", "4", "--load", save, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
    run_distributed(train_tiny, 2, MUON + resumed, "gpt", 2, tmp_path / "b.jsonl")
    losses = losses_by_iteration(tmp_path / "b.jsonl")
    assert [losses[3], losses[4]] == pytest.approx(reference[2:], rel=1e-5)


def test_flags():
    args = tiny_args(["--num-layers", "1", "--train-iters", "1", "--optimizer", "dist_muon"], world_size=2)
    assert (args.optimizer, args.use_distributed_optimizer) == ("muon", True)
    with pytest.raises(ArgumentError, match="^--optimizer muon does not support --generalized-tensor-parallel-size"):
        tiny_args(["--num-layers", "1", "--optimizer", "muon", "--generalized-tensor-parallel-size", "2"], world_size=2)
    with pytest.raises(ArgumentError, match=r"^invalid optimizer flags: .*multiple of 5 for quintic"):
        tiny_args(["--num-layers", "1", "--optimizer", "muon", "--muon-num-ns-steps", "7"])
