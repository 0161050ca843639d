#!/usr/bin/env python3
"""Training tokens/s of our train step against a minimal single-process PyTorch loop.

Both train the same Llama-style model (RMSNorm, SwiGLU, RoPE, untied, no biases) from the
same weights on the same batches with the same AdamW settings. The plain loop is
HuggingFace's LlamaForCausalLM with our weights mapped in, ``torch.optim.AdamW`` and
``clip_grad_norm_``: an independent reference for our losses as well as a speed baseline.

    python benchmarks/train_throughput.py [--steps 20] [--hidden-size 256] [--num-layers 4]

Prints both loss curves' first steps, both tokens/s (median step time, the two loops
interleaved step by step) and their speed ratio (ours / plain: the median over steps of the
plain step's time over ours, which the machine's load affects least).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def llama_flags(
    hidden_size=64,
    num_layers=2,
    heads=4,
    query_groups=2,
    seq_length=32,
    micro_batch_size=2,
    global_batch_size=8,
    steps=10,
    lr=1e-3,
    data=("--mock-data", "--vocab-size", "128"),
) -> list[str]:
    """Flags of a Llama-style GPT for megatron-pretrain-gpt (constant LR, no warm-up)."""
    return [
        "--num-layers",
        str(num_layers),
        "--hidden-size",
        str(hidden_size),
        "--num-attention-heads",
        str(heads),
        "--num-query-groups",
        str(query_groups),
        "--ffn-hidden-size",
        str(4 * hidden_size),
        "--seq-length",
        str(seq_length),
        "--max-position-embeddings",
        str(seq_length),
        "--micro-batch-size",
        str(micro_batch_size),
        "--global-batch-size",
        str(global_batch_size),
        "--train-iters",
        str(steps),
        "--lr",
        str(lr),
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--distributed-backend",
        "gloo",
        "--log-interval",
        "1000000",
        "--hidden-dropout",
        "0.0",
        "--attention-dropout",
        "0.0",
        "--eval-iters",
        "0",
        *data,
    ]


def build_trainer(flags: list[str]):
    """Our Trainer for ``flags`` on the current (single-rank) world."""
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import Trainer

    args = parse_args(flags, model_family="gpt", world_size=1)
    return Trainer(args, initialize_megatron(args))


class PlainLoop:
    """LlamaForCausalLM + AdamW + clip_grad_norm_, with the trainer's current weights."""

    def __init__(self, trainer):
        from transformers import LlamaConfig, LlamaForCausalLM

        from megatron.core.models.hf_mapping import llama_state_dict_to_hf

        args, config = trainer.args, trainer.config
        hf_config = LlamaConfig(
            vocab_size=trainer.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.ffn_hidden_size,
            num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_query_groups,
            max_position_embeddings=args.max_position_embeddings,
            rms_norm_eps=config.layernorm_epsilon,
            rope_theta=float(args.rotary_base),
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )
        self.model = LlamaForCausalLM(hf_config).float()
        ours = trainer.model.module.state_dict()
        self.model.load_state_dict(llama_state_dict_to_hf(ours, config, trainer.vocab_size), strict=True)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=args.lr,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_eps,
        )
        self.clip_grad = args.clip_grad

    def step(self, batch: dict) -> float:
        """One step on a whole global batch; returns the mean per-token loss."""
        logits = self.model(input_ids=batch["tokens"]).logits.float()
        losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        mask = batch["loss_mask"].flatten().float()
        loss = (losses * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def global_batches(trainer, steps: int) -> list[dict]:
    """The global batches our trainer will read (single rank: all micro-batches), concatenated."""
    iterator = trainer.data_iterator(trainer.train_ds, 0)
    batches = []
    for _ in range(steps):
        micro = [next(iterator) for _ in range(trainer.args.num_microbatches)]
        batches.append({k: torch.cat([m[k] for m in micro]) for k in micro[0]})
    return batches


def compare(flags: list[str], steps: int) -> dict:
    """Train both for ``steps`` from the same weights; return their losses and tokens/s."""
    torch.manual_seed(0)
    trainer = build_trainer(flags)
    plain = PlainLoop(trainer)
    batches = global_batches(trainer, steps)
    tokens_per_step = trainer.args.global_batch_size * trainer.args.seq_length

    # Interleave the two loops step by step (which one goes first alternates) and take the
    # median over steps of each pair's time ratio: load from other processes on the machine
    # hits the two steps of a pair alike, so their ratio is steadier than a ratio of medians.
    iterator = trainer.data_iterator(trainer.train_ds, 0)
    plain_losses, our_losses, plain_times, our_times = [], [], [], []

    cpu_times = {"plain": [], "ours": []}

    def timed(step, losses, times):
        start, cpu = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - start)
        cpu_times["plain" if times is plain_times else "ours"].append(time.process_time() - cpu)

    for index, batch in enumerate(batches):
        pair = [
            lambda batch=batch: timed(lambda: plain.step(batch), plain_losses, plain_times),
            lambda: timed(lambda: trainer.train_step(iterator)[0], our_losses, our_times),
        ]
        for run in pair if index % 2 == 0 else pair[::-1]:
            run()
    plain_s, ours_s = statistics.median(plain_times[1:] or plain_times), statistics.median(our_times[1:] or our_times)
    pair_ratios = [p / o for p, o in zip(plain_times, our_times, strict=True)]
    return {
        "ours_losses": our_losses,
        "plain_losses": plain_losses,
        "ours_tokens_per_s": tokens_per_step / ours_s,
        "plain_tokens_per_s": tokens_per_step / plain_s,
        "ratio": statistics.median(pair_ratios[1:] or pair_ratios),
        "cpu_time_ratio": statistics.median(cpu_times["plain"][1:] or cpu_times["plain"])
        / statistics.median(cpu_times["ours"][1:] or cpu_times["ours"]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    opts = parser.parse_args(argv)
    flags = llama_flags(
        hidden_size=opts.hidden_size,
        num_layers=opts.num_layers,
        heads=8,
        query_groups=4,
        seq_length=opts.seq_length,
        micro_batch_size=opts.micro_batch_size,
        global_batch_size=opts.global_batch_size,
        steps=opts.steps,
    )
    result = compare(flags, opts.steps)
    print(f"first losses  ours : {[round(x, 5) for x in result['ours_losses'][:5]]}")
    print(f"first losses  plain: {[round(x, 5) for x in result['plain_losses'][:5]]}")
    print(f"tokens/s      ours : {result['ours_tokens_per_s']:.1f}")
    print(f"tokens/s      plain: {result['plain_tokens_per_s']:.1f}")
    print(f"ratio ours/plain   : {result['ratio']:.3f}  (median over steps of plain/ours step time)")
    print(f"cpu-time ratio     : {result['cpu_time_ratio']:.3f}  (plain/ours process CPU time per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
