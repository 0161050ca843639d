"""--moe-layer-freq: Megatron's forms read without evaluating code; the GPT decoder gets MoE
layers exactly where the frequency says and dense MLPs elsewhere; EP2 trains the single-process
curve of such a model; bad values fail before any process group; Mixtral export refuses it."""

import pytest

from megatron.core.models import hf_mapping
from megatron.training.arguments import ArgumentError, model_record_from_args
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny

RUN = [*CURVE_RUN, "--num-layers", "4", "--eval-iters", "0", "--log-interval", "1", "--train-iters", "3"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.0"]


@pytest.mark.parametrize(
    "text, value",
    [("2", 2), ("[0,1,1,1]", [0, 1, 1, 1]), ("([0]*1+[1]*3)", [0, 1, 1, 1]), ("[1]*2 + [0]*2", [1, 1, 0, 0])],
)
def test_megatrons_forms_are_read(text, value):
    args = tiny_args(RUN + MOE + ["--moe-layer-freq", text])
    assert args.moe_layer_freq == value
    assert model_record_from_args(args, 64).config.moe_layer_freq == value


def _layer_kinds(flags):
    from megatron.core import parallel_state
    from megatron.core.models.model_record import model_from_record

    pgc = parallel_state.initialize_model_parallel()
    model = model_from_record(model_record_from_args(tiny_args(RUN + MOE + flags), 64), pgc)
    return [type(layer.mlp).__name__ for layer in model.decoder.layers]


@pytest.mark.parametrize(
    "freq, kinds",
    [("2", ["MoELayer", "MLP", "MoELayer", "MLP"]), ("([0]*1+[1]*3)", ["MLP", "MoELayer", "MoELayer", "MoELayer"])],
)
def test_the_decoder_places_moe_layers_as_the_frequency_says(freq, kinds):
    assert run_distributed(_layer_kinds, 1, ["--moe-layer-freq", freq]) == [kinds]


def test_expert_parallelism_trains_the_single_process_curve(tmp_path):
    flags = RUN + MOE + ["--moe-layer-freq", "([0]*1+[1]*3)"]
    run_distributed(train_tiny, 1, flags, "gpt", 1, tmp_path / "ep1.jsonl")
    run_distributed(train_tiny, 2, flags + ["--expert-model-parallel-size", "2"], "gpt", 2, tmp_path / "ep2.jsonl")
    assert loss_curve(tmp_path / "ep2.jsonl") == pytest.approx(loss_curve(tmp_path / "ep1.jsonl"), rel=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--moe-layer-freq", "2"], "^--moe-layer-freq needs --num-experts"),
        (MOE + ["--moe-layer-freq", "[0,1]"], r"moe_layer_freq must be an integer >= 1 or a list of 4"),
        (MOE + ["--moe-layer-freq", "[0,2,1,1]"], r"zeros and ones"),
    ],
)
def test_bad_frequencies(flags, message):
    with pytest.raises(ArgumentError, match=message):
        tiny_args(RUN + flags)


def test_code_is_never_evaluated(capsys):
    with pytest.raises(SystemExit):
        tiny_args(RUN + MOE + ["--moe-layer-freq", "__import__('os').getcwd()"])
    assert "is not an integer or a list of integers" in capsys.readouterr().err


def test_mixtral_export_refuses_dense_layers_among_moe_ones():
    record = model_record_from_args(tiny_args(RUN + MOE + ["--moe-layer-freq", "2", "--swiglu"]), 64)
    with pytest.raises(hf_mapping.HFMappingError, match=r"dense layers among the MoE ones \(moe_layer_freq 2\)"):
        hf_mapping.mixtral_config_to_hf(record)
