"""Must-show of issue 22 on CPU: a tiny dropless MoE GPT trains to the EP1 loss curve under
EP2, EP4, EP2xTP2 (experts sharded over expert-TP = TP 2), EP2 with ETP2 (experts sharded over
two data-parallel ranks; in the checkpoint test) and EP2xPP2."""

import pytest

from tests.unit_tests.training.test_layout_equivalence import _curve

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--train-iters", "4"]


@pytest.fixture(scope="module")
def ep1_curve(tmp_path_factory):
    return _curve("gpt", MOE, 1, tmp_path_factory.mktemp("ep1"))


@pytest.mark.parametrize(
    "world, flags",
    [
        (2, ["--expert-model-parallel-size", "2"]),
        (4, ["--expert-model-parallel-size", "4"]),
        (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
        (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    ],
    ids=["EP2", "EP4", "EP2xTP2", "EP2xPP2"],
)
def test_expert_parallel_loss_curve_equals_ep1(ep1_curve, tmp_path, world, flags):
    curve = _curve("gpt", MOE + flags, world, tmp_path)
    assert len(curve) == len(ep1_curve) == 4
    assert all(abs(a - b) <= 1e-5 for a, b in zip(curve, ep1_curve, strict=True)), (curve, ep1_curve)
    assert curve[-1] < curve[0]


def test_sinkhorn_routing_trains_to_the_same_curve_under_ep2(tmp_path):
    sinkhorn = ["--moe-router-load-balancing-type", "sinkhorn"]
    reference = _curve("gpt", MOE + sinkhorn, 1, tmp_path / "ep1")
    curve = _curve("gpt", MOE + sinkhorn + ["--expert-model-parallel-size", "2"], 2, tmp_path / "ep2")
    assert curve == pytest.approx(reference, abs=1e-5) and curve[-1] < curve[0]


def _train(flags, world_size, metrics_jsonl):
    from megatron.training.arguments import parse_args
    from megatron.training.training import pretrain
    from tests.unit_tests.training.test_layout_equivalence import COMMON

    args = parse_args(
        COMMON + MOE + flags + ["--metrics-jsonl", metrics_jsonl], model_family="gpt", world_size=world_size
    )
    state = pretrain(args)
    return state.iteration, state.consumed_samples


def test_checkpoint_saved_at_ep4_resumes_at_ep1_and_ep2xtp2(tmp_path):
    from megatron.core.dist_checkpointing import write_latest_iteration
    from tests.unit_tests.dist_harness import run_distributed
    from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration

    save, optimizer = str(tmp_path / "ep4"), ["--use-distributed-optimizer"]
    flags = ["--expert-model-parallel-size", "4", "--save", save, "--save-interval", "2", *optimizer]
    run_distributed(_train, 4, flags, 4, str(tmp_path / "ep4.jsonl"))
    straight = loss_curve(tmp_path / "ep4.jsonl")
    write_latest_iteration(save, 2)
    for name, world, layout in [
        ("ep1", 1, []),
        ("ep2xtp2", 4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    ]:
        metrics = str(tmp_path / f"{name}.jsonl")
        results = run_distributed(_train, world, ["--load", save, *layout, *optimizer], world, metrics)
        assert results[0] == (4, 32), name
        resumed = losses_by_iteration(metrics)
        assert sorted(resumed) == [3, 4], name  # it picks up at iteration 3
        assert all(abs(resumed[i] - straight[i - 1]) <= 1e-5 for i in (3, 4)), (name, resumed, straight)


def test_ep2_with_etp2_trains_to_the_ep1_curve_and_resumes_at_etp1(ep1_curve, tmp_path):
    """EP2 with ETP2 (gated experts sharded ``[gate_r; up_r]`` over two data-parallel ranks)
    gives the EP1 curve; its checkpoint stores each expert weight as pieces of one global tensor,
    and one process with whole experts resumes it to the same losses."""
    from megatron.core.dist_checkpointing import write_latest_iteration
    from tests.unit_tests.dist_harness import run_distributed
    from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration

    save, optimizer = str(tmp_path / "etp2"), ["--use-distributed-optimizer"]
    flags = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2", *optimizer]
    run_distributed(_train, 4, [*flags, "--save", save, "--save-interval", "2"], 4, str(tmp_path / "etp2.jsonl"))
    straight = loss_curve(tmp_path / "etp2.jsonl")
    assert all(abs(a - b) <= 1e-5 for a, b in zip(straight, ep1_curve, strict=True)), (straight, ep1_curve)
    write_latest_iteration(save, 2)
    metrics = str(tmp_path / "etp1.jsonl")
    assert run_distributed(_train, 1, ["--load", save, *optimizer], 1, metrics)[0] == (4, 32)
    resumed = losses_by_iteration(metrics)
    assert sorted(resumed) == [3, 4]
    print("DEBUG", resumed, straight)
    assert all(abs(resumed[i] - straight[i - 1]) <= 1e-5 for i in (3, 4)), (resumed, straight)


def _expert_biases_after_training(flags, world_size):
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import Trainer
    from tests.unit_tests.training.tiny_training import tiny_args

    args = tiny_args(["--num-layers", "2", *MOE, "--moe-router-enable-expert-bias", *flags], world_size=world_size)
    trainer = Trainer(args, initialize_megatron(args))
    trainer.train()
    return [
        m.expert_bias.tolist() for chunk in trainer.model_chunks for m in chunk.modules() if hasattr(m, "expert_bias")
    ]


def test_expert_bias_balances_from_the_counts_of_every_data_parallel_rank():
    """--moe-router-enable-expert-bias: the trainer takes one balancing step per iteration from
    token counts summed over the data-parallel ranks (each routed other tokens), so the replicas
    keep one bias."""
    from tests.unit_tests.dist_harness import run_distributed

    first, second = run_distributed(_expert_biases_after_training, 2, [], 2)
    assert len(first) == 2 and any(b != 0.0 for bias in first for b in bias)  # the bias moved
    assert first == second


def test_expert_bias_is_checkpointed_and_resumes_under_another_layout(tmp_path):
    """The expert bias is model state outside the optimizer: saved after iteration 1 (when one
    balancing step has moved it), a run resumed at EP2 routes with the saved bias and continues
    the uninterrupted run's losses (with the bias lost, the routing and the losses differ)."""
    from megatron.core.dist_checkpointing import write_latest_iteration
    from tests.unit_tests.dist_harness import run_distributed
    from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration

    save = str(tmp_path / "ep1")
    bias = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    bias += ["--moe-router-bias-update-rate", "5"]  # one step decides the choice
    run_distributed(_train, 1, [*bias, "--save", save, "--save-interval", "1"], 1, str(tmp_path / "straight.jsonl"))
    straight = loss_curve(tmp_path / "straight.jsonl")
    write_latest_iteration(save, 1)
    metrics = str(tmp_path / "ep2.jsonl")
    resume = [*bias, "--load", save, "--expert-model-parallel-size", "2"]
    assert run_distributed(_train, 2, resume, 2, metrics)[0] == (4, 32)
    resumed = losses_by_iteration(metrics)
    assert sorted(resumed) == [2, 3, 4]
    assert all(abs(resumed[i] - straight[i - 1]) <= 1e-5 for i in (2, 3, 4)), (resumed, straight)
