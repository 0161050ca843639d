"""Every command line README.md shows in a ```bash block runs as a subprocess, the way a user
types it: here, from a working directory holding the inputs the command names (a
``tokenizer.json``, a ``docs.jsonl``, an HF model in ``hf/llama``), or in the test named for
it in :data:`RUN_ELSEWHERE` (the serving commands, on that test's checkpoint and a free port).
Commands run here on the CPU, on any machine (CUDA hidden, as CI runs them); GPU-only
commands are checked for ``--help`` only; the install
commands are checked against pyproject.toml and .ci/run (running them would reinstall the
package under test), and the test command is what .ci/run runs. A README command none of
these covers fails :func:`test_every_readme_command_is_covered`.

Also the Must-show of the checkpoint carrying its tokenizer: a model trained by the README's
``megatron-pretrain-gpt`` command with an HF tokenizer file, its run directory moved to
another directory and the tokenizer file deleted, serves one completion over HTTP and
converts from there.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron.core.models.model_record import (
    MODEL_RECORD_FILENAME,
    load_model_weights,
    model_from_record,
    read_model_record,
)
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.tokenizers import HuggingFaceTokenizer
from tests.help_commands import run_help_commands
from tests.readme import (
    README,
    ROOT,
    command_env,
    readme_command,
    readme_commands,
    run_command,
    start_command,
)
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.inference import test_serve_launchers as serving_tests
from tests.unit_tests.inference.launched_server import serving
from tests.unit_tests.tokenizers.tiny_hf_tokenizer import generated_sentences, train_tiny_tokenizer

QUICKSTART = "bash examples/quickstart.sh"
TEST_COMMAND = "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q"
INSTALL = "pip install "
TRAIN_HYBRID = "torchrun --standalone --nproc-per-node 2 --no-python megatron-pretrain-hybrid"
PREPROCESS = "megatron-preprocess-data"
TRAIN_DOCS = "megatron-pretrain-gpt --data-path"
INSPECT = "megatron-inspect-ckpt runs/docs"
HF_TO_OURS = "megatron-convert --loader hf --saver megatron"
OURS_TO_HF = "megatron-convert --loader megatron --saver hf"
DCP_EXPORT = 'python -c "from torch.distributed.checkpoint.format_utils'
FUNCTIONAL = "python tests/functional_tests/run_functional.py"
BENCHMARKS = {
    "python benchmarks/train_throughput.py": "ratio ours/plain",
    "python benchmarks/checkpoint_io.py": "ours/plain load throughput ratio",
}
# GPU-only: run on CPU as their --help (the command's program, then --help).
GPU_ONLY = {
    "python benchmarks/inference_throughput.py --device cuda": "python benchmarks/inference_throughput.py --help",
    "python benchmarks/handoff_transfer.py --device cuda:0": "python benchmarks/handoff_transfer.py --help",
    "python -m benchmarks.paged_attention_gpu": "python -m benchmarks.paged_attention_gpu --help",
    "python -m benchmarks.mamba_kernels_gpu": "python -m benchmarks.mamba_kernels_gpu --help",
    "python -m benchmarks.inference_kernels_gpu": "python -m benchmarks.inference_kernels_gpu --help",
    "python benchmarks/gpu_train.py --config all": "python benchmarks/gpu_train.py --help",
    "python -m benchmarks.grad_accumulation_fusion": "python -m benchmarks.grad_accumulation_fusion --help",
    "python benchmarks/fused_kernels_gpu.py --output-json": "python benchmarks/fused_kernels_gpu.py --help",
    "python benchmarks/moe_gpu.py --output-json": "python benchmarks/moe_gpu.py --help",
    "python -m benchmarks.cp_attention_gpu": "python -m benchmarks.cp_attention_gpu --help",
    "python benchmarks/gpu_decode.py --output-json": "python benchmarks/gpu_decode.py --help",
    "python tools/run_test_bucket.py gpu2": "python tools/run_test_bucket.py --help",
    "bash tools/gpu_checks.sh all": "bash tools/gpu_checks.sh --help",
    "bash tools/gpu_checks.sh perf": "bash tools/gpu_checks.sh --help",
}
# Run by another test, which takes the command from the README (readme_command(NAME)).
RUN_ELSEWHERE = {
    name: (serving_tests, test)
    for name, test in {
        "README_SERVE": "test_serve_answers_openai_completions_and_streamed_chat_with_offline_greedy_text",
        "README_CURL_HEALTH": "test_serve_answers_openai_completions_and_streamed_chat_with_offline_greedy_text",
        "README_CURL_COMPLETIONS": "test_serve_answers_openai_completions_and_streamed_chat_with_offline_greedy_text",
        "README_CURL_CHAT": "test_serve_answers_openai_completions_and_streamed_chat_with_offline_greedy_text",
        "README_SERVE_TORCHRUN": "test_launcher_with_tensor_parallelism_gives_the_single_rank_greedy_text",
        "README_SERVE_REPLICAS": "test_launcher_with_two_data_parallel_replicas_serves_concurrent_requests",
        "README_OFFLINE": "test_disaggregated_load_reports_what_offline_load_reports",
        "README_DISAGGREGATED": "test_disaggregated_load_reports_what_offline_load_reports",
    }.items()
}
RUN_HERE = [QUICKSTART, TRAIN_HYBRID, PREPROCESS, TRAIN_DOCS, INSPECT, HF_TO_OURS, OURS_TO_HF, DCP_EXPORT]
RUN_HERE += [*BENCHMARKS, *GPU_ONLY, FUNCTIONAL]
DOC_SENTENCES = 300


def _cpu_env(**extra: str) -> dict:
    """README commands run on the CPU here, on any machine (as CI runs them)."""
    return command_env(CUDA_VISIBLE_DEVICES="", **extra)


def _owners(command: str) -> list[str]:
    """Which of this module's tables cover ``command`` (the test command is CI's own)."""
    if command == TEST_COMMAND:
        return ["CI"]
    if command.startswith(INSTALL):
        return ["install"]
    prefixes = RUN_HERE + [getattr(module, name) for name, (module, _) in RUN_ELSEWHERE.items()]
    return [prefix for prefix in prefixes if command.startswith(prefix)]


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) > 20
    uncovered = {command: _owners(command) for command in commands if len(_owners(command)) != 1}
    assert not uncovered, f"README commands without exactly one test: {uncovered}"
    for prefix in RUN_HERE:
        readme_command(prefix)  # each names exactly one README command
    for name, (module, test) in RUN_ELSEWHERE.items():
        readme_command(getattr(module, name))
        assert callable(getattr(module, test)), f"{module.__name__}.{test} runs {name}"
        uses = len(re.findall(rf"\b{name}\b", Path(module.__file__).read_text())) - 1  # less its definition
        assert uses > 0, f"{module.__name__} never runs {name}"


def test_readme_shows_no_command_line_outside_its_bash_blocks():
    """Inline code that is a command with arguments must be one of the bash blocks' commands
    (so that it is run here), not a variant only a reader runs."""
    text = re.sub(r"```.*?```", "", README.read_text(encoding="utf-8"), flags=re.S)
    programs = ("python ", "python3 ", "torchrun ", "bash ", "pip ", "curl ", "megatron-")
    spans = re.findall(r"`([^`\n]+)`", text)
    inline = [span for span in spans if span.startswith(programs) and " " in span and span != "python -m"]
    commands = readme_commands()
    assert [span for span in inline if span not in commands] == []


# ------------------------------------------------------------------ commands CI and pip run


def _ci_lines() -> list[str]:
    return (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_the_test_command_is_what_ci_runs():
    assert readme_command("pip install torch==2.13.0 &&") == TEST_COMMAND
    ci = _ci_lines()
    for line in ("python3 -m pip install -q torch==2.13.0", "python3 -m pip install -q -e '.[test]'"):
        assert line in ci
    assert ci[-1] == "python3 -m pytest -q"


def test_install_commands_name_the_pinned_torch_and_extras_pyproject_declares():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installs = [c for c in readme_commands() if c.startswith(INSTALL) and c != TEST_COMMAND]
    assert "pip install torch==2.13.0" in installs and "python3 -m pip install -q torch==2.13.0" in _ci_lines()
    for command in installs:
        target = command.removeprefix(INSTALL)
        if target.startswith("torch"):
            assert target == "torch==2.13.0"
            continue
        match = re.fullmatch(r"-e (\.|'\.\[(\w+)\]')", target)
        assert match, command
        assert match.group(2) is None or match.group(2) in extras, command


# ------------------------------------------------------------------ the main job


def test_quickstart_trains_tp2_pp2_on_four_processes_and_generates(tmp_path):
    """The main job as a short run (its extra flags go to the training command)."""
    run_dir = tmp_path / "runs" / "quickstart"
    short = " --train-iters 10 --lr-warmup-iters 2 --log-interval 5"
    done = run_command(readme_command(QUICKSTART) + short, ROOT, env=_cpu_env(RUN_DIR=str(run_dir)))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm loss"] for r in records if r["type"] == "train"]
    assert len(losses) == 2 and losses[1] < losses[0]  # logged at iterations 5 and 10
    assert [r["type"] for r in records if r["type"] != "train"] == ["validation", "test"]  # after training
    assert f"saved checkpoint {run_dir}/iter_0000010 (iteration 10)" in done.stdout
    report = json.loads((run_dir / "generations.json").read_text())
    assert [len(r["generated_tokens"]) for r in report["requests"]] == [96, 96, 96]
    assert done.stdout.count("----- prompt: ") == 3


# ------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A user's directory: a tokenizer.json, a docs.jsonl, an HF Llama in hf/llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("readme")
    train_tiny_tokenizer(directory)
    docs = [{"text": text} for text in generated_sentences(count=DOC_SENTENCES, seed=5)]
    (directory / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory / "hf" / "llama")
    return directory


def test_hybrid_training_command_runs_under_torchrun_with_gtp2(workdir):
    done = run_command(readme_command(TRAIN_HYBRID), workdir, env=_cpu_env())
    assert "iteration       10/      10" in done.stdout


# ------------------------------------------------------------------ data, checkpoints, a moved checkpoint


@dataclass
class MovedRun:
    """The README's data commands' run, moved away from the files it was trained with."""

    directory: Path  # holds runs/docs now
    tokenizer_json: bytes  # the (deleted) tokenizer file's bytes
    train_output: str
    losses: list[float]


@pytest.fixture(scope="module")
def moved_docs_run(workdir, tmp_path_factory) -> MovedRun:
    """Preprocess docs.jsonl and train on it with tokenizer.json (the README's commands, in
    ``workdir``), then move runs/docs to another directory and delete the tokenizer file and
    the preprocessed data."""
    run_command(readme_command(PREPROCESS), workdir, env=_cpu_env())
    trained = run_command(readme_command(TRAIN_DOCS), workdir, env=_cpu_env())
    records = [json.loads(line) for line in (workdir / "runs" / "docs" / "metrics.jsonl").read_text().splitlines()]
    tokenizer_json = (workdir / "tokenizer.json").read_bytes()
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "runs").mkdir()
    shutil.move(workdir / "runs" / "docs", elsewhere / "runs" / "docs")
    (workdir / "tokenizer.json").unlink()
    shutil.rmtree(workdir / "data")
    return MovedRun(elsewhere, tokenizer_json, trained.stdout, [r["lm loss"] for r in records if r["type"] == "train"])


def test_data_commands_train_on_the_preprocessed_docs_and_the_checkpoint_keeps_the_tokenizer(moved_docs_run):
    assert "saved checkpoint runs/docs/iter_0000010 (iteration 10)" in moved_docs_run.train_output
    assert len(moved_docs_run.losses) == 10 and moved_docs_run.losses[-1] < moved_docs_run.losses[0]
    checkpoint = moved_docs_run.directory / "runs" / "docs" / "iter_0000010"
    assert (checkpoint / "tokenizer" / "tokenizer.json").read_bytes() == moved_docs_run.tokenizer_json
    stored = json.loads((checkpoint / MODEL_RECORD_FILENAME).read_text())
    assert stored["version"] == 2 and stored["tokenizer"] == {"type": "HuggingFaceTokenizer", "model": "tokenizer"}
    record = read_model_record(str(checkpoint.parent))
    assert record.tokenizer.model == str(checkpoint / "tokenizer")
    assert record.vocab_size == record.tokenizer.build().vocab_size == 320


def test_inspect_command_lists_the_checkpoint(moved_docs_run):
    done = run_command(readme_command(INSPECT), moved_docs_run.directory, env=_cpu_env())
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()[2:-1]}
    assert rows["embedding.word_embeddings.weight"][:2] == ["320x64", "float32"]
    assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in rows


def _weights(path: str) -> dict[str, torch.Tensor]:
    model = model_from_record(read_model_record(path), ProcessGroupCollection.from_layout(RankLayout()))
    load_model_weights(model, path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_dcp_export_command_writes_the_weights_torch_reads(moved_docs_run):
    run_command(readme_command(DCP_EXPORT), moved_docs_run.directory, env=_cpu_env())
    exported = torch.load(moved_docs_run.directory / "full.pt", weights_only=True)
    (weights,) = run_distributed(_weights, 1, str(moved_docs_run.directory / "runs" / "docs"))
    embedding = exported["embedding.word_embeddings.weight"]  # its true rows (the model pads the vocabulary)
    assert embedding.shape[0] == 320 and torch.equal(embedding, weights["embedding.word_embeddings.weight"][:320])
    assert torch.equal(exported["decoder.final_layernorm.weight"], weights["decoder.final_layernorm.weight"])


def test_a_moved_checkpoint_serves_and_converts_with_the_tokenizer_it_carries(moved_docs_run, tmp_path):
    """The original tokenizer file is gone and the run directory is elsewhere: the server
    answers with the greedy text of an offline run decoded by the original tokenizer, and
    the converter writes a checkpoint that carries the tokenizer on."""
    here, prompt, max_tokens = moved_docs_run.directory, "the cat sat", 8
    (tmp_path / "tokenizer.json").write_bytes(moved_docs_run.tokenizer_json)
    original = HuggingFaceTokenizer(tmp_path / "tokenizer.json")
    with serving(start_command("megatron-serve --load runs/docs --port 0", here, env=_cpu_env())) as (server, url):
        request = urllib.request.Request(
            url + "/v1/completions",
            json.dumps(
                {"model": "megatron", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            ).encode(),
            {"Content-Type": "application/json"},
        )
        completion = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert server.stop(signal.SIGTERM) == 0
    # The offline engine on the same checkpoint with the server's pool (16 requests of 2 blocks).
    offline = (
        f"python {ROOT}/examples/inference/offline_inference.py --load runs/docs --prompts '{prompt}' "
        f"--num-tokens-to-generate {max_tokens} --max-requests 16 --kv-block-count 32 --output-json offline.json"
    )
    run_command(offline, here, env=_cpu_env())
    (reference,) = json.loads((here / "offline.json").read_text())["requests"]
    tokens = reference["generated_tokens"]
    assert len(tokens) == max_tokens and completion["choices"][0]["text"] == original.detokenize(tokens)

    run_command(
        "megatron-convert --loader megatron --saver megatron --load-dir runs/docs --save-dir runs/docs-tp2 "
        "--target-tensor-parallel-size 2",
        here,
        env=_cpu_env(),
    )
    converted = here / "runs" / "docs-tp2" / "iter_0000010"
    assert (converted / "tokenizer" / "tokenizer.json").read_bytes() == moved_docs_run.tokenizer_json
    record = read_model_record(str(converted))
    assert record.config.tensor_model_parallel_size == 2 and record.tokenizer.model == str(converted / "tokenizer")
    (before,), (after,) = (run_distributed(_weights, 1, str(p)) for p in (here / "runs" / "docs", converted))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_hf_conversion_commands_round_trip_bit_identically(workdir):
    from safetensors.torch import load_file

    run_command(readme_command(HF_TO_OURS), workdir, env=_cpu_env())
    assert read_model_record(str(workdir / "runs" / "llama")).config.tensor_model_parallel_size == 2
    run_command(readme_command(OURS_TO_HF), workdir, env=_cpu_env())
    original = load_file(workdir / "hf" / "llama" / "model.safetensors")
    returned = load_file(workdir / "hf" / "llama-back" / "model.safetensors")
    assert original.keys() == returned.keys() and all(torch.equal(original[k], returned[k]) for k in original)


# ------------------------------------------------------------------ benchmarks, GPU-only commands, functional cases


@pytest.mark.parametrize("prefix", sorted(BENCHMARKS))
def test_benchmark_commands_run_and_print_their_ratio(prefix, tmp_path):
    done = run_command(readme_command(prefix), ROOT, env=_cpu_env())
    assert BENCHMARKS[prefix] in done.stdout


FUNCTIONAL_HELP = FUNCTIONAL + " --help"


@pytest.fixture(scope="module")
def help_outputs() -> dict[str, dict]:
    """Every ``python ... --help`` below, run in one subprocess (one import of torch and the
    package for all of them); a bash command runs on its own."""
    python_commands = [c for c in [*GPU_ONLY.values(), FUNCTIONAL_HELP] if c.startswith("python")]
    outputs = run_help_commands(python_commands, ROOT, env=_cpu_env())
    for command in [*GPU_ONLY.values(), FUNCTIONAL_HELP]:
        if command not in outputs:
            done = run_command(command, ROOT, timeout_s=60, env=_cpu_env(), check=False)
            outputs[command] = {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
    return outputs


def _help(outputs: dict[str, dict], command: str) -> str:
    done = outputs[command]
    assert done["returncode"] == 0, f"{command!r} exited {done['returncode']}:\n{done['stdout']}\n{done['stderr']}"
    return done["stdout"]


@pytest.mark.parametrize("prefix", sorted(GPU_ONLY))
def test_gpu_only_commands_parse_their_arguments(prefix, help_outputs):
    """GPU-only: on this CPU suite only the command's --help runs (the lead runs them on GPUs)."""
    readme_command(prefix)
    assert _help(help_outputs, GPU_ONLY[prefix]).startswith("usage: ")


def test_functional_cases_command(help_outputs):
    """The CI subset is what tests/functional_tests/test_functional_cases.py runs, case by
    case through run_case (the function the command loops over); here its CLI parses."""
    from tests.functional_tests import test_functional_cases

    assert readme_command(FUNCTIONAL) == FUNCTIONAL + " --subset ci"
    assert callable(test_functional_cases.test_ci_case_matches_goldens)
    assert "--subset SUBSET" in _help(help_outputs, FUNCTIONAL_HELP)
