"""The serving launchers end to end on a checkpoint trained here (2 steps of pretraining):
the README's ``megatron-serve`` command (one process; its curl commands too) and its torchrun
form (TP2) and its form with two supervised data-parallel replicas, and the script wrapper
``examples/inference/serve.py`` answer the `openai` client with
the greedy text of an offline LLM run of the same checkpoint and shut down cleanly on a
signal; the README's ``disaggregated.py --load`` command reports what its
``offline_inference.py --load`` command reports; the shared loader builds inference models."""

import concurrent.futures
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import torch

from megatron.core.dist_checkpointing import CheckpointingError
from megatron.core.inference.checkpoint_loading import load_inference_model
from megatron.core.inference.llm import LLM
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.server import ServerConfigError, bind_socket, launcher
from megatron.core.inference.server.chat_template import ChatTemplate
from megatron.core.models.model_record import (
    MODEL_RECORD_FILENAME,
    load_model_weights,
    model_from_record,
    read_model_record,
    resolve_checkpoint_dir,
)
from megatron.core.process_groups import ProcessGroupCollection, RankLayout
from megatron.core.tokenizers.byte_level import ByteLevelTokenizer
from megatron.training.arguments import parse_args as parse_training_args
from megatron.training.training import pretrain
from tests.readme import ROOT, command_env, needs_a_device_per_rank, readme_command, run_command, start_command
from tests.unit_tests.dist_harness import device, run_distributed
from tests.unit_tests.inference.launched_server import kill_tree, serving

SERVE = str(ROOT / "examples" / "inference" / "serve.py")  # a script wrapper of megatron-serve
# The README commands these tests run (on their checkpoint, on a free port).
README_SERVE = "megatron-serve --load runs/quickstart"
README_SERVE_TORCHRUN = "torchrun --standalone --nproc-per-node 2 --no-python megatron-serve"
README_SERVE_REPLICAS = "megatron-serve --data-parallel-size 2"
README_CURL_HEALTH = "curl http://127.0.0.1:8000/health"
README_CURL_COMPLETIONS = "curl http://127.0.0.1:8000/v1/completions"
README_CURL_CHAT = "curl -N http://127.0.0.1:8000/v1/chat/completions"
README_OFFLINE = "python examples/inference/offline_inference.py --load runs/quickstart"
README_DISAGGREGATED = "python examples/inference/disaggregated.py --load runs/quickstart"
TRAIN_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "128",  # the README's curl commands ask for 64 tokens
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--train-iters",
    "2",
    "--lr",
    "1e-2",
    "--mock-data",
    # Megatron's defaults are dropout 0.1 and 100 evaluation batches at the end: this run pins its own.
    "--hidden-dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
    "--eval-iters",
    "0",
    "--log-interval",
    "100",
    "--init-method-std",
    "0.2",
]
# The server's engine and the offline reference use the same pool geometry and step size.
ENGINE_FLAGS = ["--kv-block-size", "8", "--max-requests", "8", "--max-tokens-per-step", "64"]
ENGINE_KWARGS = dict(block_size=8, num_blocks=64, max_requests=8, max_tokens_per_step=64)
MAX_TOKENS = 8
PROMPTS = ["Hello", "The sky is", "def f(x):", "import os", "1, 2, 3,", "class A", "Once upon", "zzz"]
CHAT = [{"role": "user", "content": "Hi there"}]
TOKENIZER = ByteLevelTokenizer()
ON_CPU = not torch.cuda.is_available()  # where launched servers run


def _pretrain(save_dir):
    backend = "nccl" if device().type == "cuda" else "gloo"
    args = parse_training_args(
        TRAIN_FLAGS + ["--distributed-backend", backend, "--save", save_dir], model_family="gpt", world_size=1
    )
    pretrain(args)


def trained_checkpoint(tmp_path_factory) -> str:
    """The checkpoint serving tests serve (2 steps of pretraining), made once per test session
    (the fault tests of tests/unit_tests/inference/faults serve it too; nothing writes to it)."""
    path = tmp_path_factory.getbasetemp() / "serve_ckpt"
    if not (path / "latest_checkpointed_iteration.txt").exists():
        run_distributed(_pretrain, 1, str(path))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory)


def _offline_greedy(checkpoint_dir, token_prompts):
    """Greedy tokens of an in-process LLM over the checkpoint, built with the checkpointing
    functions themselves (not the loader under test)."""
    pg = ProcessGroupCollection.from_layout(RankLayout())
    model = model_from_record(read_model_record(checkpoint_dir), pg)
    load_model_weights(model, checkpoint_dir)
    llm = LLM(model.to(device()), TOKENIZER, pg_collection=pg, **ENGINE_KWARGS)
    outputs = llm.generate(token_prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=True))
    return [(o.token_ids, o.log_probs) for o in outputs]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Prompt text (completions, or the rendered chat) -> (greedy text, its tokens' log-probs).

    Log-probs as well as text: the byte-level text of a barely trained model is full of
    invalid UTF-8, where different tokens can decode to the same replacement character."""
    texts = PROMPTS + [ChatTemplate(TOKENIZER).render(CHAT)]
    outputs = run_distributed(_offline_greedy, 1, checkpoint, [TOKENIZER.tokenize(t) for t in texts])[0]
    assert len({tuple(tokens) for tokens, _ in outputs}) == len(texts), "every prompt should give its own output"
    return {
        text: (TOKENIZER.detokenize(tokens), log_probs)
        for text, (tokens, log_probs) in zip(texts, outputs, strict=True)
    }


def _serving_readme_command(prefix: str, checkpoint: str):
    """The README's serving command starting with ``prefix``, on ``checkpoint`` and a free port,
    with the engine flags of the offline reference."""
    replacements = {"runs/quickstart": checkpoint, "--port 8000": "--port 0 " + " ".join(ENGINE_FLAGS)}
    return serving(start_command(readme_command(prefix), ROOT, replacements))


def _check_readme_curl_commands(url: str) -> None:
    """The README's curl commands against the server at ``url``: health, a completion, a
    streamed chat completion (server-sent events ending in [DONE])."""
    run = functools.partial(run_command, cwd=ROOT, replacements={"http://127.0.0.1:8000": url}, timeout_s=60)
    assert json.loads(run(readme_command(README_CURL_HEALTH)).stdout) == {"status": "ok"}
    completion = json.loads(run(readme_command(README_CURL_COMPLETIONS)).stdout)
    assert completion["object"] == "text_completion" and completion["choices"][0]["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 64
    events = [line for line in run(readme_command(README_CURL_CHAT)).stdout.splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(event.startswith("data: {") for event in events[:-1])
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}


def _assert_generations(got: list[tuple[str, list[float]]], prompts: list[str], reference, exact: bool) -> None:
    """The reference's greedy text for every prompt, with its log-probs: bitwise when ``exact``
    (the CPU reference kernels are batch invariant), else to rounding (CUDA kernels pick
    reductions by shape; tensor parallelism sums in another order)."""
    assert len(got) == len(prompts)
    for (text, log_probs), prompt in zip(got, prompts, strict=True):
        want_text, want_log_probs = reference[prompt]
        assert text == want_text, prompt
        if exact:
            assert log_probs == want_log_probs, prompt
        else:
            torch.testing.assert_close(log_probs, want_log_probs, rtol=0, atol=1e-5)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(api: openai.OpenAI, prompt) -> list[tuple[str, list[float]]]:
    """Greedy (text, log-probs) of each choice."""
    result = api.completions.create(model="megatron", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    return [(choice.text, choice.logprobs.token_logprobs) for choice in result.choices]


def _engine_tokens(url: str) -> dict[str, float]:
    """``tokens_generated`` per engine replica, from /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'megatron_engine_tokens_generated\{engine="([^"]+)"\} (\S+)', text)}


def _wait_for_engine_tokens(url: str, total: int) -> dict[str, float]:
    """Engines report stats a few times a second: wait until they account for ``total`` tokens."""
    deadline = time.monotonic() + 10
    while True:
        tokens = _engine_tokens(url)
        if sum(tokens.values()) >= total or time.monotonic() > deadline:
            return tokens
        time.sleep(0.1)


def test_serve_answers_openai_completions_and_streamed_chat_with_offline_greedy_text(checkpoint, reference):
    with _serving_readme_command(README_SERVE, checkpoint) as (server, url):
        health = urllib.request.urlopen(url + "/health", timeout=10)
        assert (health.status, json.loads(health.read())) == (200, {"status": "ok"})
        _check_readme_curl_commands(url)
        api = _client(url)
        _assert_generations(_complete(api, PROMPTS[1]), PROMPTS[1:2], reference, exact=ON_CPU)
        chunks = [
            chunk.choices[0]
            for chunk in api.chat.completions.create(
                model="megatron", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, stream=True
            )
            if chunk.choices
        ]
        streamed = "".join(choice.delta.content or "" for choice in chunks)
        log_probs = [entry.logprob for choice in chunks if choice.logprobs for entry in choice.logprobs.content]
        _assert_generations([(streamed, log_probs)], [ChatTemplate(TOKENIZER).render(CHAT)], reference, exact=ON_CPU)
        assert server.stop(signal.SIGINT) == 0  # Ctrl-C


def test_launcher_with_two_data_parallel_replicas_serves_concurrent_requests(checkpoint, reference):
    needs_a_device_per_rank(2)
    with _serving_readme_command(README_SERVE_REPLICAS, checkpoint) as (server, url):
        api = _client(url)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            outputs = list(pool.map(lambda prompt: _complete(api, prompt)[0], PROMPTS))
        _assert_generations(outputs, PROMPTS, reference, exact=ON_CPU)
        tokens = _wait_for_engine_tokens(url, MAX_TOKENS * len(PROMPTS))
        assert set(tokens) == {"replica-0", "replica-1"} and all(tokens.values()), tokens  # both replicas served
        assert sum(tokens.values()) == MAX_TOKENS * len(PROMPTS)
        server.stop(signal.SIGTERM)


def test_launcher_with_tensor_parallelism_gives_the_single_rank_greedy_text(checkpoint, reference):
    needs_a_device_per_rank(2)
    with _serving_readme_command(README_SERVE_TORCHRUN, checkpoint) as (server, url):
        _assert_generations(_complete(_client(url), PROMPTS[:4]), PROMPTS[:4], reference, exact=False)
        assert _wait_for_engine_tokens(url, MAX_TOKENS * 4) == {"replica-0": MAX_TOKENS * 4}  # one replica
        server.stop(signal.SIGTERM)


def test_disaggregated_load_reports_what_offline_load_reports(checkpoint, tmp_path):
    """The README's two commands on this checkpoint, with a short chunked-prefill run."""
    flags = "--num-tokens-to-generate 6 --kv-block-size 4 --max-tokens-per-step 8 --enable-chunked-prefill"
    runs = [
        start_command(
            readme_command(prefix),
            ROOT,
            {
                "runs/quickstart": checkpoint,
                "--output-json out.json": f"--output-json {tmp_path / f'{i}.json'} {flags}",
            },
        )
        for i, prefix in enumerate((README_OFFLINE, README_DISAGGREGATED))
    ]  # side by side: the wait is mostly start-up
    reports = []
    try:
        for i, run in enumerate(runs):
            output, _ = run.communicate(timeout=180)
            assert run.returncode == 0, output
            reports.append(json.loads((tmp_path / f"{i}.json").read_text())["requests"])
    finally:
        for run in runs:
            kill_tree(run)
    assert reports[1] == reports[0]
    assert [r["prompt_tokens"] for r in reports[0]] == [TOKENIZER.tokenize(p) for p in ("def fib(n):", "import ")]


def _tensor_parallel_logits(checkpoint_dir, tokens):
    pg = ProcessGroupCollection.from_layout(RankLayout.for_world(2, tp=2))
    model, tokenizer, record = load_inference_model(checkpoint_dir, pg)
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=device())).cpu()  # this rank's vocabulary shard
    return model.training, model.config.sequence_parallel, type(tokenizer).__name__, record, logits


def _single_rank_logits(checkpoint_dir, tokens):
    pg = ProcessGroupCollection.from_layout(RankLayout())
    model = model_from_record(read_model_record(checkpoint_dir), pg)
    load_model_weights(model, checkpoint_dir)
    with torch.no_grad():
        return model.to(device()).eval()(torch.tensor([tokens], device=device())).cpu()


def test_loader_builds_an_eval_model_without_sequence_parallelism_for_any_layout(checkpoint, tmp_path):
    copy = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint, copy)
    iteration = resolve_checkpoint_dir(copy)
    record = read_model_record(iteration)
    # as a sequence-parallel training run writes it
    record = record.replace(config=dataclasses.replace(record.config, sequence_parallel=True))
    with open(os.path.join(iteration, MODEL_RECORD_FILENAME), "w", encoding="utf-8") as f:
        json.dump(record.to_dict(), f)
    tokens = TOKENIZER.tokenize(PROMPTS[2])
    expected = run_distributed(_single_rank_logits, 1, copy, tokens)[0]
    ranks = run_distributed(_tensor_parallel_logits, 2, copy, tokens)
    for training, sequence_parallel, tokenizer, loaded_record, _ in ranks:
        assert (training, sequence_parallel, tokenizer) == (False, False, "ByteLevelTokenizer")
        assert loaded_record == record  # the record as stored
    vocab = TOKENIZER.vocab_size
    logits = torch.cat([rank[-1] for rank in ranks], dim=-1)[..., :vocab]
    torch.testing.assert_close(logits, expected[..., :vocab], rtol=1e-5, atol=1e-5)


def test_loader_names_a_directory_that_is_no_checkpoint(tmp_path):
    with pytest.raises(CheckpointingError, match="is neither a checkpoint iteration directory"):
        load_inference_model(str(tmp_path), None)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: --load"),
        (["--load", "ckpt", "--reasoning-parser", "think"], "argument --reasoning-parser: invalid choice: 'think'"),
        (["--load", "ckpt", "--tool-call-parser", "json"], "argument --tool-call-parser: invalid choice: 'json'"),
    ],
)
def test_launcher_flags_are_checked_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launcher.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_launcher_refuses_a_server_option_out_of_range():
    args = launcher.parse_args(["--load", "ckpt", "--max-prompt-tokens", "0"])
    with pytest.raises(ServerConfigError, match="max_prompt_tokens must be a positive integer"):
        launcher.serve_checkpoint(args)


def test_serve_on_a_taken_port_fails_at_once_naming_it(checkpoint):
    with bind_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, SERVE, "--load", checkpoint, "--port", str(port)],
            env=command_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        f"error: cannot serve on 127.0.0.1:{port} (Address already in use); pick "
        "another --port, or --port 0 for a free one"
    )


def test_serve_names_a_load_directory_that_is_no_checkpoint_before_starting(tmp_path, capsys):
    assert launcher.main(["--load", str(tmp_path), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path} is neither a checkpoint iteration directory (no model_config.json) nor a checkpoint "
        "root (no latest_checkpointed_iteration.txt)\n"
    )
