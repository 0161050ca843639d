"""The start-up summary: parameter counts per pipeline stage add up to the single-process
model's parameters under TP2 x PP2 (tied output layer counted once), and the lines rank 0
prints before the first iteration."""

import pytest

from megatron.core import parallel_state
from megatron.core.models.model_record import model_from_record
from megatron.training.arguments import model_record_from_args, parse_args
from megatron.training.startup_summary import dataset_lines, model_lines, parameter_counts_per_stage, run_lines
from tests.unit_tests.dist_harness import run_distributed

FLAGS = [
    *("--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16"),
    *("--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3"),
    *("--mock-data", "--vocab-size", "64", "--distributed-backend", "gloo", "--use-flash-attn"),
]


def _counts(flags, world_size):
    args = parse_args(flags, world_size=world_size)
    pgc = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    model = model_from_record(model_record_from_args(args, 64), pgc)
    return parameter_counts_per_stage(model, pgc, "cpu"), run_lines(args, pgc), model_lines(args, [1, 2])


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_per_stage_add_up_to_the_whole_model(tied):
    flags = FLAGS + ([] if tied else ["--untie-embeddings-and-output-weights"])
    ((single, _, _),) = run_distributed(_counts, 1, flags, 1)
    parallel = flags + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    results = run_distributed(_counts, 4, parallel, 4)
    stages, lines, _ = results[0]
    assert all(r[0] == stages for r in results) and len(stages) == 2
    assert sum(stages) == sum(single)
    assert lines[-2].startswith("> layout: world 4 = TP 2 x GTP 1 x CP 1 x DP 1 x PP 2")
    assert lines[-2].endswith("; experts EP 1 x ETP 2 x expert-DP 1")
    assert lines[-1].startswith("> tokens per step: 128 = global batch 8 x sequence 16 (4 micro-batches of 2")
    assert "  note: --use-flash-attn: attention already uses fused SDPA" in lines
    assert "  --use-flash-attn" in lines and "  --mock-data" in lines


def test_model_and_dataset_lines():
    assert model_lines(None, [1500, 2_500_000]) == [
        "> parameters: stage 0: 1.50K, stage 1: 2.50M; total 2.50M (2,501,500)"
    ]
    assert dataset_lines({"train": None}) == ["> datasets:", "    train: none"]


def test_an_evaluation_batch_of_its_own_size_gets_a_line():
    flags = FLAGS + ["--eval-global-batch-size", "12", "--eval-micro-batch-size", "3"]
    ((_, lines, _),) = run_distributed(_counts, 1, flags, 1)
    assert lines[-1] == "> evaluation step: global batch 12 (4 micro-batches of 3 per data rank)"
    ((_, default_lines, _),) = run_distributed(_counts, 1, FLAGS, 1)
    assert default_lines[-1].startswith("> tokens per step:")
