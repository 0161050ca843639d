"""Re-segmenting hybrid patterns without '|': balanced by layer count or by an override that
must describe the same layers; a NemotronH model converted from HF (its pattern has no '|')
runs offline inference at PP2 (torchrun, a subprocess) with HF's prompt log-probs."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import NemotronHForCausalLM

from megatron.core.models.hybrid.hybrid_layer_pattern import HybridPatternError, segment_for_pipeline
from megatron.core.models.model_record import read_model_record
from tests.readme import subprocess_env
from tests.unit_tests.models.hybrid.test_hf_nemotron import hf_config

PATTERN = "M*-M*M-"


def test_a_pattern_without_boundaries_is_split_by_layer_count_and_says_where():
    assert segment_for_pipeline(PATTERN, 2) == (
        "M*-M|*M-",
        "hybrid layer pattern 'M*-M*M-' has no '|': for 2 pipeline stages it is split as 'M*-M|*M-' "
        "(balanced by layer count: [4, 3] layers per stage)",
    )
    assert segment_for_pipeline(PATTERN, 3)[0] == "M*-|M*|M-"
    assert segment_for_pipeline("M*/*-", 2)[0] == "M|*/*-"  # the MTP part stays
    assert segment_for_pipeline(PATTERN, 1) == (PATTERN, None)
    assert segment_for_pipeline("M*|M-", 2) == ("M*|M-", None)  # boundaries given: kept


def test_an_override_must_describe_the_same_layers():
    assert segment_for_pipeline(PATTERN, 2, "M|*-M*M-")[0] == "M|*-M*M-"
    with pytest.raises(HybridPatternError, match=r"override 'M\*\|M\*M-' describes other layers than"):
        segment_for_pipeline(PATTERN, 2, "M*|M*M-")
    with pytest.raises(HybridPatternError, match="has 2 layers, fewer than the 3 pipeline stages"):
        segment_for_pipeline("M*", 3)


def _nemotron_h():
    torch.manual_seed(0)
    model = NemotronHForCausalLM(hf_config(vocab_size=259, hybrid_override_pattern=PATTERN)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def test_nemotron_h_from_hf_runs_offline_inference_at_pp2_with_hf_prompt_log_probs(tmp_path):
    hf = _nemotron_h()
    hf.save_pretrained(tmp_path / "hf")
    convert = [sys.executable, "-m", "megatron.core.models.checkpoint_converter", "--loader", "hf", "--saver"]
    result = subprocess.run(
        [*convert, "megatron", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "ours")],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert read_model_record(str(tmp_path / "ours")).layer_pattern == PATTERN  # no '|': PP1 by default
    prompts = [[5, 17, 99, 42, 7, 130, 64, 8, 1, 77, 23], [200, 11, 12, 13, 14, 15, 90]]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "megatron.core.inference.offline_inference", "--load", str(tmp_path / "ours"),
         "--pipeline-model-parallel-size", "2", "--prompt-token-ids-file", str(tmp_path / "ids.jsonl"),
         "--num-tokens-to-generate", "1", "--kv-block-size", "4", "--output-json", str(tmp_path / "out.json")],
        capture_output=True, text=True, env=subprocess_env(), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "for 2 pipeline stages it is split as 'M*-M|*M-'" in result.stderr
    requests = json.loads((tmp_path / "out.json").read_text())["requests"]
    for prompt, request in zip(prompts, requests, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(ids).logits[0, :-1].double(), dim=-1)
        expected = log_probs.gather(1, ids[0, 1:, None])[:, 0]
        assert request["prompt_tokens"] == prompt
        torch.testing.assert_close(torch.tensor(request["prompt_log_probs"], dtype=torch.float64), expected,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


def _convert(argv):
    from megatron.core.models import checkpoint_converter

    return checkpoint_converter.convert(argv)


def test_the_converter_segments_for_its_target_pipeline_size_and_prints_where(tmp_path, capfd):
    from tests.unit_tests.dist_harness import run_distributed

    _nemotron_h().save_pretrained(tmp_path / "hf")
    base = ["--loader", "hf", "--saver", "megatron", "--load-dir", str(tmp_path / "hf")]
    run_distributed(_convert, 1, [*base, "--save-dir", str(tmp_path / "a"), "--target-pipeline-parallel-size", "2"])
    assert read_model_record(str(tmp_path / "a")).layer_pattern == "M*-M|*M-"
    assert "it is split as 'M*-M|*M-' (balanced by layer count: [4, 3] layers per stage)" in capfd.readouterr().out
    run_distributed(_convert, 1, [*base, "--save-dir", str(tmp_path / "b"), "--hybrid-layer-pattern", "M*|-M*M-"])
    assert read_model_record(str(tmp_path / "b")).layer_pattern == "M*|-M*M-"
