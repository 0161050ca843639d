"""--load without model flags: the checkpoint's model record gives them (before any process
group); a contradicting flag is an error naming both values; layout flags may differ (the run
reshards); a --load directory with no checkpoint yet trains from scratch (Megatron's
--save X --load X)."""

import json
from pathlib import Path

import pytest

from megatron.core.models.model_record import MODEL_RECORD_FILENAME, read_model_record
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.training import pretrain
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import losses_by_iteration

TRAINING = [
    *("--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--lr-decay-style", "constant"),
    *("--mock-data", "--distributed-backend", "gloo", "--eval-iters", "0", "--log-interval", "1"),
]
MODEL = [
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2"),
    *("--ffn-hidden-size", "64", "--seq-length", "16", "--normalization", "RMSNorm", "--swiglu"),
    *("--position-embedding-type", "rope", "--rotary-base", "500", "--untie-embeddings-and-output-weights"),
    *("--disable-bias-linear", "--apply-layernorm-1p", "--hidden-dropout", "0.0", "--attention-dropout", "0.0"),
    *("--vocab-size", "96", "--add-qkv-bias", "--use-rope-scaling", "--rope-scaling-factor", "16"),
    *("--rotary-interleaved", "--qk-layernorm"),
]


def _train(flags, world_size):
    state = pretrain(parse_args(flags, world_size=world_size))
    return state.iteration


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ckpt"))
    run_distributed(_train, 1, TRAINING + MODEL + ["--train-iters", "2", "--lr-decay-iters", "4", "--save", save], 1)
    return save


def test_the_record_gives_every_model_flag(checkpoint):
    args = parse_args(TRAINING + ["--train-iters", "4", "--load", checkpoint], world_size=1)
    given = parse_args(TRAINING + MODEL + ["--train-iters", "4"], world_size=1)
    for dest in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "ffn_hidden_size",
        "seq_length",
        "normalization",
        "swiglu",
        "position_embedding_type",
        "rotary_base",
        "untie_embeddings_and_output_weights",
        "disable_bias_linear",
        "apply_layernorm_1p",
        "add_qkv_bias",
        "rotary_interleaved",
        "qk_layernorm",
        "use_rope_scaling",
        "rope_scaling_factor",
        "squared_relu",
        "hidden_dropout",
        "attention_dropout",
        "vocab_size",
    ):
        assert getattr(args, dest) == getattr(given, dest), dest
    assert args.checkpoint_record == read_model_record(checkpoint)


def test_a_contradicting_model_flag_names_both_values(checkpoint):
    flags = TRAINING + ["--train-iters", "4", "--load", checkpoint, "--hidden-size", "48", "--num-layers", "2"]
    with pytest.raises(ArgumentError, match=r"--hidden-size 48 \(checkpoint: 32\)") as error:
        parse_args(flags, world_size=1)
    assert "--num-layers" not in str(error.value)  # agreeing flags are fine
    with pytest.raises(ArgumentError, match="holds a gpt model; train it with megatron-pretrain-gpt"):
        parse_args(TRAINING + ["--train-iters", "4", "--load", checkpoint], model_family="hybrid", world_size=1)


def test_resume_with_no_model_flags_under_another_layout(checkpoint, tmp_path):
    metrics, save = tmp_path / "m.jsonl", tmp_path / "resumed"
    flags = TRAINING + ["--train-iters", "4", "--load", checkpoint, "--save", str(save)]
    flags += ["--tensor-model-parallel-size", "2", "--metrics-jsonl", str(metrics)]
    assert run_distributed(_train, 2, flags, 2) == [4, 4]
    assert sorted(losses_by_iteration(metrics)) == [3, 4]  # it went on from iteration 2
    before = json.loads((_iteration(checkpoint, 2) / MODEL_RECORD_FILENAME).read_text())
    after = json.loads((_iteration(save, 4) / MODEL_RECORD_FILENAME).read_text())
    assert after["config"].pop("tensor_model_parallel_size") == 2
    assert before["config"].pop("tensor_model_parallel_size") == 1
    assert after == before  # the same model, resharded


def _iteration(root, iteration) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def test_a_load_directory_without_a_checkpoint_trains_from_scratch(tmp_path, capfd):
    flags = TRAINING + MODEL + ["--train-iters", "1", "--load", str(tmp_path), "--save", str(tmp_path)]
    assert run_distributed(_train, 1, flags, 1) == [1]
    assert f"--load {tmp_path}: no checkpoint there yet; training from scratch" in capfd.readouterr().out
    with pytest.raises(ArgumentError, match="--finetune --load .*: there is no checkpoint there"):
        parse_args(TRAINING + MODEL + ["--train-iters", "1", "--load", str(tmp_path / "x"), "--finetune"])


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid"]


def test_moe_flags_come_from_the_record_and_training_behaviour_from_the_flags(tmp_path):
    save = str(tmp_path / "moe")
    flags = TRAINING + MODEL + MOE + ["--moe-aux-loss-coeff", "0.01", "--train-iters", "1", "--save", save]
    run_distributed(_train, 1, flags, 1)
    args = parse_args(TRAINING + ["--train-iters", "2", "--load", save], world_size=1)
    assert (args.num_experts, args.moe_router_topk, args.moe_router_score_function) == (4, 2, "sigmoid")
    assert args.moe_aux_loss_coeff == 0.01  # the run's behaviour, from the record when not given
    changed = parse_args(TRAINING + ["--train-iters", "2", "--load", save, "--moe-aux-loss-coeff", "0.1"], world_size=1)
    assert changed.moe_aux_loss_coeff == 0.1
    from megatron.training.arguments import tokenizer_record_from_args
    from megatron.training.checkpoint_args import record_for_run

    record = record_for_run(changed, changed.checkpoint_record, tokenizer_record_from_args(changed))
    assert record.config.moe_aux_loss_coeff == 0.1 and record.config.num_moe_experts == 4
    with pytest.raises(ArgumentError, match=r"--num-experts 8 \(checkpoint: 4\)"):
        parse_args(TRAINING + ["--train-iters", "2", "--load", save, "--num-experts", "8"], world_size=1)
    with pytest.raises(ArgumentError, match=r"--num-experts 8 \(checkpoint: None\)"):
        parse_args(TRAINING + ["--train-iters", "2", "--num-experts", "8"] + ["--load", _dense(tmp_path)], world_size=1)


def _dense(tmp_path) -> str:
    save = str(tmp_path / "dense")
    run_distributed(_train, 1, TRAINING + MODEL + ["--train-iters", "1", "--save", save], 1)
    return save
