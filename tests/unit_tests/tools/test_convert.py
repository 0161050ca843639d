"""The converter (megatron.core.models.checkpoint_converter, ``megatron-convert``): HF (Llama,
GPT-2, NemotronH, Mixtral, Qwen3-MoE, DeepSeek-V3; random weights, save_pretrained) -> ours -> HF is bit-identical, the
converted model (loaded at TP2) gives HF's logits, and ours -> ours re-targets the default
layout without touching the weights."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
)

from megatron.core import parallel_state
from megatron.core.models import checkpoint_converter as convert_tool
from megatron.core.models.model_record import load_model_weights, model_from_record, read_model_record
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.models.gpt.hf_moe_models import deepseek_v3_model, mixtral_model, qwen3_moe_model

HF_MODELS = {
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        )
    ),
    "mixtral": lambda: mixtral_model(vocab_size=100, seed=0),
    "qwen3_moe": lambda: qwen3_moe_model(vocab_size=100, seed=0),
    "deepseek_v3": lambda: deepseek_v3_model(vocab_size=100, seed=0),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
    "nemotron_h": lambda: NemotronHForCausalLM(
        NemotronHConfig(
            vocab_size=100,
            hidden_size=32,
            layers_block_type=None,
            hybrid_override_pattern="M*-M",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            mlp_hidden_act="relu2",
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=8,
            conv_kernel=4,
            chunk_size=4,
            max_position_embeddings=32,
            tie_word_embeddings=False,
            time_step_min=1e-3,
            time_step_max=0.1,
        )
    ),
}
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))


def _hf_model(name):
    torch.manual_seed(0)
    model = HF_MODELS[name]().eval()
    with torch.no_grad():  # norms and biases start at constants: make every weight non-trivial
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def _convert(argv):
    return convert_tool.convert(argv)


def _logits_at_record_layout(path, ids):
    record = read_model_record(path)
    tp = record.config.tensor_model_parallel_size
    pg = parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = model_from_record(record, pg, parallel_output=False).eval()
    load_model_weights(model, path)
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_hf_to_ours_and_back_is_bit_identical_and_keeps_the_logits(tmp_path, name):
    hf = _hf_model(name)
    hf_dir, ours, back_dir = str(tmp_path / "hf"), str(tmp_path / "ours"), str(tmp_path / "back")
    hf.save_pretrained(hf_dir)
    run_distributed(
        _convert,
        1,
        [
            "--loader",
            "hf",
            "--saver",
            "megatron",
            "--load-dir",
            hf_dir,
            "--save-dir",
            ours,
            "--target-tensor-parallel-size",
            "2",
        ],
    )
    run_distributed(_convert, 1, ["--loader", "megatron", "--saver", "hf", "--load-dir", ours, "--save-dir", back_dir])
    back = AutoModelForCausalLM.from_pretrained(back_dir).eval()
    same_config = {k: v for k, v in back.config.to_dict().items() if k != "_name_or_path"}
    assert type(back) is type(hf) and same_config == {
        k: v for k, v in hf.config.to_dict().items() if k != "_name_or_path"
    }
    original, returned = hf.state_dict(), back.state_dict()
    assert original.keys() == returned.keys()
    assert all(torch.equal(original[k], returned[k]) for k in original)
    logits = run_distributed(_logits_at_record_layout, 2, ours, IDS)
    with torch.no_grad():
        expected = hf(IDS).logits
    for got in logits:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _state(path):
    parallel_state.initialize_model_parallel()
    model = model_from_record(read_model_record(path))
    load_model_weights(model, path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_ours_to_ours_retargets_the_default_layout(tmp_path):
    hf_dir, ours, retargeted = str(tmp_path / "hf"), str(tmp_path / "ours"), str(tmp_path / "pp2")
    _hf_model("llama").save_pretrained(hf_dir)
    run_distributed(_convert, 1, ["--loader", "hf", "--saver", "megatron", "--load-dir", hf_dir, "--save-dir", ours])
    run_distributed(
        _convert,
        1,
        [
            "--loader",
            "megatron",
            "--saver",
            "megatron",
            "--load-dir",
            ours,
            "--save-dir",
            retargeted,
            "--target-pipeline-parallel-size",
            "2",
            "--target-generalized-tensor-parallel-size",
            "2",
        ],
    )
    config = read_model_record(retargeted).config
    assert (config.pipeline_model_parallel_size, config.generalized_tensor_parallel_size) == (2, 2)
    (before,), (after,) = run_distributed(_state, 1, ours), run_distributed(_state, 1, retargeted)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_bad_requests_fail_with_a_message(capsys):
    with pytest.raises(
        convert_tool.ConversionError,
        match=r"HF architectures \['BertForMaskedLM'\] are not supported; "
        r"supported: \['DeepseekV3ForCausalLM', 'GPT2LMHeadModel', 'LlamaForCausalLM', 'MixtralForCausalLM', "
        r"'NemotronHForCausalLM', 'Qwen3MoeForCausalLM'\]",
    ):
        convert_tool.hf_family(["BertForMaskedLM"])
    assert (
        convert_tool.main(
            [
                "--loader",
                "hf",
                "--saver",
                "hf",
                "--load-dir",
                "x",
                "--save-dir",
                "y",
                "--target-tensor-parallel-size",
                "0",
            ]
        )
        == 2
    )
    assert "--target-tensor-parallel-size must be >= 1, got 0" in capsys.readouterr().err
