"""Offline batch generation with the dynamic inference engine, from the command line: the
command behind ``examples/inference/offline_inference.py``
(``python -m megatron.core.inference.offline_inference``).

Run on one process, or under torchrun with tensor / pipeline parallelism, e.g.::

    torchrun --nproc-per-node 2 examples/inference/offline_inference.py \\
        --tensor-model-parallel-size 2 --prompts "Hello" "The sky is" \\
        --num-tokens-to-generate 32 --enable-chunked-prefill --output-json out.json

With ``--load DIR`` (a training checkpoint: root or ``iter_*`` directory) the model and its
tokenizer come from the checkpoint's record and the weights are loaded for this run's layout;
without it a model with random weights is built from the model flags (smoke tests, benchmarks).
Prompts come from ``--prompts``, ``--prompts-file`` (one per line) or ``--prompt-token-ids-file``
(JSON lines, each a list of token ids). ``--output-json`` gets
``{"requests": [...], "stats": {...}}`` with the requests in prompt order.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron.core import parallel_state
from megatron.core.config import TransformerConfig
from megatron.core.inference.checkpoint_loading import default_device, load_inference_model
from megatron.core.inference.engines import add_cuda_graph_flag, add_long_prefill_flag
from megatron.core.inference.llm import LLM
from megatron.core.inference.sampling import SamplingParams
from megatron.core.models.model_record import ModelRecord, TokenizerRecord, model_from_record
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.tokenizers.base import MegatronTokenizer
from megatron.core.tokenizers.factory import DEFAULT_TOKENIZER_TYPE, build_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("prompts")
    source.add_argument("--prompts", nargs="+", default=None, help="prompt strings")
    source.add_argument("--prompts-file", default=None, help="text file, one prompt per line")
    source.add_argument("--prompt-token-ids-file", default=None, help="JSON lines, each a list of token ids")
    model = parser.add_argument_group("model (random weights unless --load)")
    model.add_argument("--load", default=None, help="checkpoint directory (model config is read from it)")
    model.add_argument("--model-type", choices=("gpt", "hybrid"), default="gpt")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--num-query-groups", type=int, default=None)
    model.add_argument("--ffn-hidden-size", type=int, default=None)
    model.add_argument("--hybrid-layer-pattern", default=None, help="e.g. 'M*-M' (hybrid models)")
    model.add_argument("--mtp-num-layers", type=int, default=0, help="MTP depths (for speculative decoding)")
    model.add_argument(
        "--max-sequence-length", type=int, default=None, help="default: the checkpoint's, or 512 for a random model"
    )
    model.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE)
    model.add_argument("--tokenizer-model", default=None)
    model.add_argument("--tensor-model-parallel-size", type=int, default=1)
    model.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--num-tokens-to-generate", type=int, default=32)
    engine.add_argument("--kv-block-size", type=int, default=16)
    engine.add_argument("--kv-block-count", type=int, default=None, help="KV blocks (default: enough for the batch)")
    engine.add_argument("--max-requests", type=int, default=None)
    engine.add_argument("--paused-block-budget", type=int, default=None)
    engine.add_argument("--max-tokens-per-step", type=int, default=256)
    engine.add_argument("--enable-prefix-caching", action="store_true")
    engine.add_argument("--enable-chunked-prefill", action="store_true")
    add_long_prefill_flag(engine)
    engine.add_argument("--num-speculative-tokens", type=int, default=0)
    add_cuda_graph_flag(engine)
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--seed", type=int, default=1234, help="model init seed; request i samples with seed + i")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if sum(x is not None for x in (args.prompts, args.prompts_file, args.prompt_token_ids_file)) != 1:
        parser.error("give exactly one of --prompts, --prompts-file, --prompt-token-ids-file")
    return args


def read_prompts(args) -> list:
    if args.prompts is not None:
        return list(args.prompts)
    if args.prompts_file is not None:
        with open(args.prompts_file, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    with open(args.prompt_token_ids_file, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def random_model_record(args: argparse.Namespace, vocab_size: int) -> ModelRecord:
    """The record of the random model the model flags describe (layout-invariant weights)."""
    num_layers = len(args.hybrid_layer_pattern.replace("|", "")) if args.hybrid_layer_pattern else args.num_layers
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        normalization="RMSNorm",
        add_bias_linear=False,
        mtp_num_layers=args.mtp_num_layers or None,
        init_seed=args.seed,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        mamba_num_heads=max(args.hidden_size // 16, 2 * args.tensor_model_parallel_size),
        mamba_head_dim=16,
        mamba_num_groups=args.tensor_model_parallel_size,
    )
    tokenizer = TokenizerRecord(args.tokenizer_type, args.tokenizer_model)
    max_sequence_length = args.max_sequence_length or 512
    if args.model_type == "hybrid":
        pattern = args.hybrid_layer_pattern or "M*" * (num_layers // 2)
        return ModelRecord(
            "hybrid", config, vocab_size, max_sequence_length, layer_pattern=pattern, tokenizer=tokenizer
        )
    return ModelRecord(
        "gpt", config, vocab_size, max_sequence_length, position_embedding_type="rope", tokenizer=tokenizer
    )


def kv_block_count(args: argparse.Namespace, prompt_lengths: list[int], max_sequence_length: int) -> int:
    """The KV pool's size in blocks: ``--kv-block-count``, else room for every prompt and its
    new tokens at once; never fewer than one sequence of ``max_sequence_length`` needs."""
    per_request = -(-(max(prompt_lengths) + args.num_tokens_to_generate) // args.kv_block_size)
    wanted = args.kv_block_count or len(prompt_lengths) * per_request
    return max(wanted, -(-max_sequence_length // args.kv_block_size))


def sampling_params(args: argparse.Namespace, count: int) -> list[SamplingParams]:
    """The sampling flags as one ``SamplingParams`` per prompt (seed ``--seed`` + its index),
    each asking for exactly ``--num-tokens-to-generate`` tokens and their log-probs."""
    return [
        SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed + i,
            max_tokens=args.num_tokens_to_generate,
            ignore_eos=True,
            logprobs=True,
            return_prompt_logprobs=True,
        )
        for i in range(count)
    ]


def load_model(
    args: argparse.Namespace, pg: ProcessGroupCollection
) -> tuple[torch.nn.Module, MegatronTokenizer, ModelRecord]:
    """This rank's stage of the checkpoint of ``--load``, else of the random model of the
    flags, on this rank's device; with its tokenizer and record."""
    if args.load is not None:
        return load_inference_model(
            args.load, pg, default_tokenizer_type=args.tokenizer_type, default_tokenizer_model=args.tokenizer_model
        )
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    record = random_model_record(args, tokenizer.vocab_size)
    return model_from_record(record, pg).to(default_device()), tokenizer, record


def main(argv=None) -> int:
    args = parse_args(argv)
    parallel_state.initialize_distributed("nccl" if torch.cuda.is_available() else "gloo")
    pg = parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
    )
    model, tokenizer, _ = load_model(args, pg)
    max_sequence_length = args.max_sequence_length or model.max_sequence_length
    prompts = read_prompts(args)
    lengths = [len(p) if isinstance(p, list) else len(tokenizer.tokenize(p)) for p in prompts]
    llm = LLM(
        model,
        tokenizer,
        pg_collection=pg,
        block_size=args.kv_block_size,
        num_blocks=kv_block_count(args, lengths, max_sequence_length),
        max_requests=args.max_requests or len(prompts),
        max_tokens_per_step=args.max_tokens_per_step,
        max_sequence_length=max_sequence_length,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        paused_block_budget=args.paused_block_budget,
        num_speculative_tokens=args.num_speculative_tokens,
        enable_cuda_graphs=args.enable_cuda_graphs,
    )
    params = sampling_params(args, len(prompts))
    is_reporter = dist.get_rank() == 0
    with tqdm(total=len(prompts), desc="requests", disable=not is_reporter) as bar:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, progress=bar.update)
        elapsed = time.perf_counter() - started
    stats = llm.engine.stats
    num_generated = sum(len(o.token_ids) for o in outputs)
    if is_reporter:
        for prompt, output in zip(prompts, outputs, strict=True):
            shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} prompt tokens>"
            print(f"----- prompt: {shown!r}\n{output.text}")
        print(
            f"{len(prompts)} requests, {num_generated} tokens in {elapsed:.2f} s: "
            f"{num_generated / elapsed:.1f} output tokens/s over {stats['steps']} steps "
            f"({stats['pauses']} pauses, {stats['evictions']} evictions, "
            f"{stats['prefix_cache_hits']} prefix-cache block hits)"
        )
    if is_reporter and args.output_json:
        report = {
            "requests": [
                {
                    "prompt_tokens": o.prompt_token_ids,
                    "generated_tokens": o.token_ids,
                    "generated_text": o.text,
                    "prompt_log_probs": o.prompt_log_probs,
                    "generated_log_probs": o.log_probs,
                }
                for o in outputs
            ],
            "stats": {key: stats[key] for key in ("steps", "pauses", "evictions", "prefix_cache_hits")}
            | {"output_tokens_per_s": num_generated / elapsed},
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(report, f)
    parallel_state.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
