"""examples/inference/disaggregated.py end to end (prefill and decode processes, NIXL, the
coordinator): the report equals an in-process LLM run of the same random model, and its stats
carry the bytes pulled and the transfer rate."""

import json
import os
import subprocess
import sys

from megatron.core.inference.llm import LLM
from megatron.core.inference.sampling import SamplingParams
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from tests.unit_tests.inference.engines.test_offline_example import FLAGS, ROOT, example_model
from tests.unit_tests.transformer.single_rank import on_single_rank

EXAMPLE = os.path.join(ROOT, "examples", "inference", "disaggregated.py")
PROMPTS = [[72, 101, 108, 108, 111], list(range(60, 73)), [1, 2, 3]]


@on_single_rank
def _llm_outputs(pg, ids_file, report_file):
    model, _ = example_model(ids_file, pg)
    llm = LLM(
        model,
        ByteLevelTokenizer(),
        pg_collection=pg,
        block_size=4,
        num_blocks=64,
        max_tokens_per_step=8,
        max_sequence_length=32,
        enable_chunked_prefill=True,
    )
    outputs = llm.generate(
        PROMPTS,
        [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, return_prompt_logprobs=True)]
        * 3,
    )
    report = json.loads(open(report_file).read())
    for row, output in zip(report["requests"], outputs, strict=True):
        assert row["generated_tokens"] == output.token_ids and row["generated_text"] == output.text
        assert row["generated_log_probs"] == output.log_probs
        assert row["prompt_log_probs"] == output.prompt_log_probs


def test_disaggregated_example_matches_one_engine(tmp_path):
    ids_file = tmp_path / "prompts.jsonl"
    ids_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    report_file = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, EXAMPLE, "--prompt-token-ids-file", str(ids_file), "--output-json", str(report_file), *FLAGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "3 imports pulled 14336 KV bytes" in done.stdout
    report = json.loads(report_file.read_text())
    assert [r["prompt_tokens"] for r in report["requests"]] == PROMPTS
    assert set(report["stats"]) == {
        "steps",
        "pauses",
        "evictions",
        "prefix_cache_hits",
        "output_tokens_per_s",
        "transferred_bytes",
        "transfer_gb_per_s",
    }
    # 5, 13 and 3 prompt tokens in blocks of 4: 2 + 4 + 1 blocks of K and V, 2 layers, 4 KV heads of 8 dims (fp32).
    assert report["stats"]["transferred_bytes"] == 7 * 2 * 2 * 4 * 4 * 8 * 4
    assert report["stats"]["transfer_gb_per_s"] > 0
    _llm_outputs(ids_file=str(ids_file), report_file=str(report_file))
