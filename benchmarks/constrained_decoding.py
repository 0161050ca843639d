"""Grammar-constrained decoding overhead: decode tokens/s with and without a JSON-schema grammar.

One process, one engine, the same model and prompts: ``--requests`` concurrent requests decode
free text (``ignore_eos``) or output constrained by a nested JSON schema (structured output,
xgrammar), sampled with per-request seeds. Trials alternate free / constrained; the median
tokens/s of each and the ratio constrained / free are printed, with the host time per step spent
filling and applying the grammar bitmask. Masked rows also make sampling itself cheaper (the
sampler's sort of a row that is mostly ``-inf`` is several times faster on CPU), so the ratio can
exceed 1. The tokenizer is a byte-level BPE ``tokenizer.json`` trained here on generated words to
``--vocab-size`` entries (32k by default; no downloads).

Usage: python benchmarks/constrained_decoding.py [--device cpu|cuda] [--requests 32]
       [--new-tokens 64] [--vocab-size 32000] [--hidden-size 128] [--num-layers 2]
       [--trials 3] [--threads 2] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron.core import parallel_state
from megatron.core.benchmark_report import finish
from megatron.core.config import TransformerConfig
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.sampling import SamplingParams
from megatron.core.inference.structured_output import StructuredOutputParams
from megatron.core.inference.structured_output.params import schema_text
from megatron.core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron.core.parallel_state import initialize_distributed
from megatron.core.tokenizers import HuggingFaceTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "owner": {
            "type": "object",
            "properties": {"email": {"type": "string"}, "roles": {"type": "array", "items": {"enum": ["a", "b"]}}},
            "required": ["email", "roles"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
                "required": ["sku", "qty"],
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "owner", "items"],
}


def train_tokenizer(directory: Path, vocab_size: int) -> HuggingFaceTokenizer:
    """A byte-level BPE tokenizer.json of ``vocab_size`` entries, trained on generated words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_letters + string.digits, k=rng.randint(2, 9))) for _ in range(60000)]
    lines = [" ".join(rng.choices(words, k=12)) + ' {"k": [1, 2.5], "v": null}' for _ in range(20000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return HuggingFaceTokenizer(directory)


def build_engine(args, tokenizer, pg, device) -> DynamicInferenceEngine:
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.hidden_size // 32,
        ffn_hidden_size=4 * args.hidden_size,
        normalization="RMSNorm",
        add_bias_linear=False,
        params_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        bf16=device.type == "cuda",
    )
    torch.manual_seed(0)
    vocab = -(-tokenizer.vocab_size // 128) * 128
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab, 512, position_embedding_type="rope", pg_collection=pg)
    return DynamicInferenceEngine(
        model.eval().to(device),
        max_tokens_per_step=2048,
        block_size=16,
        num_blocks=args.requests * (32 + args.new_tokens) // 16 + 64,
        max_requests=args.requests,
        max_sequence_length=512,
        tokenizer=tokenizer,
        pg_collection=pg,
        # The model pads its vocabulary; free text must not sample the padding ids (both modes pay this).
        logits_processors=[lambda logits, _: logits[:, tokenizer.vocab_size :].fill_(-float("inf"))],
    )


def decode(engine, prompts, grammar, new_tokens: int) -> tuple[int, float, float, int]:
    """Run every prompt to its end (at most ``new_tokens``); (tokens generated, seconds, seconds
    in the grammar hook, steps)."""
    hook = engine.structured_outputs.mask_logits
    hook_s = [0.0]

    def timed(*a):
        started = time.perf_counter()
        hook(*a)
        hook_s[0] += time.perf_counter() - started

    engine.structured_outputs.mask_logits = timed
    steps_before = engine.stats["steps"]
    for index, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=1.0,
            seed=index,
            max_tokens=new_tokens,
            ignore_eos=grammar is None,
            structured_output=grammar,
        )
        engine.add_request(f"{time.perf_counter_ns()}-{index}", prompt, params)
    tokens = 0
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(output.new_token_ids) for output in engine.step())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    engine.structured_outputs.mask_logits = hook
    return tokens, seconds, hook_s[0], engine.stats["steps"] - steps_before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    initialize_distributed("nccl" if device.type == "cuda" else "gloo")
    pg = parallel_state.initialize_model_parallel()
    with tempfile.TemporaryDirectory() as directory:
        tokenizer = train_tokenizer(Path(directory), args.vocab_size)
    engine = build_engine(args, tokenizer, pg, device)
    rng = random.Random(1)
    prompts = [
        [rng.randrange(1, tokenizer.vocab_size) for _ in range(rng.randint(8, 32))] for _ in range(args.requests)
    ]
    grammar = StructuredOutputParams(json_schema=schema_text(SCHEMA))
    compile_started = time.perf_counter()
    engine.structured_outputs.grammars.compile(grammar)
    compile_s = time.perf_counter() - compile_started
    decode(engine, prompts[:2], None, 8), decode(engine, prompts[:2], grammar, 8)  # warm-up
    samples = {"free": [], "constrained": []}
    generated = {"free": 0, "constrained": 0}
    hook_ms_per_step = []
    for _ in range(args.trials):
        for label, g in (("free", None), ("constrained", grammar)):
            tokens, seconds, hook_s, steps = decode(engine, prompts, g, args.new_tokens)
            samples[label].append(tokens / seconds)
            generated[label] = tokens
            if g is not None:
                hook_ms_per_step.append(1e3 * hook_s / max(steps, 1))
    free, constrained = statistics.median(samples["free"]), statistics.median(samples["constrained"])
    report = {
        "device": str(device),
        "requests": args.requests,
        "vocab_size": tokenizer.vocab_size,
        "grammar_compile_s": compile_s,
        "free_tokens_per_s": free,
        "constrained_tokens_per_s": constrained,
        "ratio_constrained_over_free": constrained / free,
        "grammar_ms_per_step": statistics.median(hook_ms_per_step),
        "tokens_per_trial": generated,
        "trials": args.trials,
    }
    print(
        f"decode tokens/s (median of {args.trials} alternating trials, {args.requests} requests, "
        f"{tokenizer.vocab_size}-entry BPE vocab, {device}): free {free:.1f}, JSON schema {constrained:.1f}, "
        f"ratio constrained/free {constrained / free:.2f} ({generated['free']} / {generated['constrained']} tokens "
        "per trial)"
    )
    print(
        f"grammar bitmask fill + apply: {report['grammar_ms_per_step']:.2f} ms per step; "
        f"schema compile {compile_s:.2f} s (once, cached)"
    )
    return finish(report, args.output_json)


if __name__ == "__main__":
    sys.exit(main())
