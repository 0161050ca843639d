"""examples/inference/offline_inference.py end to end (a subprocess): the JSON report holds
every request in prompt order with tokens and log-probs equal to an in-process LLM run of
the same random model, and ``--load`` of that model's checkpoint reproduces the report."""

import json
import os
import subprocess
import sys

from megatron.core.inference import offline_inference
from megatron.core.inference.llm import LLM
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models.model_record import model_from_record, save_model_checkpoint
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from tests.readme import ROOT, subprocess_env
from tests.unit_tests.dist_harness import device, run_distributed

EXAMPLE = os.path.join(ROOT, "examples", "inference", "offline_inference.py")
FLAGS = [
    "--num-tokens-to-generate",
    "6",
    "--kv-block-size",
    "4",
    "--kv-block-count",
    "8",
    "--max-sequence-length",
    "32",
    "--max-tokens-per-step",
    "8",
    "--enable-chunked-prefill",
    "--paused-block-budget",
    "1",
    "--hidden-size",
    "32",
    "--seed",
    "7",
]


def example_model(ids_file: str, pg):
    """The random model the example builds from FLAGS, and its record."""
    args = offline_inference.parse_args(["--prompt-token-ids-file", ids_file, *FLAGS])
    record = offline_inference.random_model_record(args, ByteLevelTokenizer().vocab_size)
    return model_from_record(record, pg).to(device()), record


def _llm_run_of_the_example_model(token_prompts, ids_file):
    tokenizer = ByteLevelTokenizer()
    pg = ProcessGroupCollection.from_layout(RankLayout())
    model, _ = example_model(ids_file, pg)
    llm = LLM(
        model,
        tokenizer,
        pg_collection=pg,
        block_size=4,
        num_blocks=64,
        max_tokens_per_step=8,
        max_sequence_length=32,
        enable_chunked_prefill=True,
    )
    return llm.generate(
        token_prompts,
        [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, return_prompt_logprobs=True)]
        * len(token_prompts),
    )


def test_offline_example_writes_the_report_of_an_llm_run(tmp_path):
    token_prompts = [[72, 101, 108, 108, 111], list(range(60, 73)), [1, 2, 3]]
    ids_file = tmp_path / "prompts.jsonl"
    ids_file.write_text("".join(json.dumps(p) + "\n" for p in token_prompts))
    report_file = tmp_path / "out.json"
    env = subprocess_env()
    done = subprocess.run(
        [sys.executable, EXAMPLE, "--prompt-token-ids-file", str(ids_file), "--output-json", str(report_file), *FLAGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "output tokens/s" in done.stdout
    report = json.loads(report_file.read_text())
    assert set(report["stats"]) == {"steps", "pauses", "evictions", "prefix_cache_hits", "output_tokens_per_s"}
    assert report["stats"]["pauses"] > 0  # 8 blocks of 4 tokens for three requests

    outputs = run_distributed(_llm_run_of_the_example_model, 1, token_prompts, str(ids_file))[0]
    assert [r["prompt_tokens"] for r in report["requests"]] == token_prompts
    for row, output in zip(report["requests"], outputs, strict=True):
        assert row["generated_tokens"] == output.token_ids
        assert row["generated_text"] == output.text
        assert row["generated_log_probs"] == output.log_probs
        assert row["prompt_log_probs"] == output.prompt_log_probs


def _save_example_model(ids_file, root):
    model, record = example_model(ids_file, ProcessGroupCollection.from_layout(RankLayout()))
    save_model_checkpoint({"model": model.sharded_state_dict()}, root, 1, record)


def test_load_reads_config_and_weights_from_a_checkpoint(tmp_path):
    ids_file = tmp_path / "prompts.jsonl"
    ids_file.write_text(json.dumps([5, 6, 7, 8]) + "\n" + json.dumps(list(range(30, 41))) + "\n")
    run_distributed(_save_example_model, 1, str(ids_file), str(tmp_path / "ckpt"))
    reports = []
    for source in (FLAGS, ["--load", str(tmp_path / "ckpt"), *FLAGS[:-4]]):  # --load: no model flags
        out = tmp_path / f"out{len(reports)}.json"
        done = subprocess.run(
            [sys.executable, EXAMPLE, "--prompt-token-ids-file", str(ids_file), "--output-json", str(out), *source],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        reports.append(json.loads(out.read_text())["requests"])
    assert reports[1] == reports[0]
