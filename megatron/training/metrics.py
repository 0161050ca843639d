"""Training logs: Megatron-style log lines, JSONL metric records, TensorBoard scalars.

Only the last pipeline stage's data-parallel rank 0 holds the loss; callers pass every
record through :class:`MetricsLogger` on that rank (``enabled=True``), which is the one
that writes. TensorBoard tags are Megatron's (:data:`TENSORBOARD_TAGS`): ``lm loss`` for
training, ``lm loss validation`` / ``lm loss test`` for evaluations, ``learning-rate``,
``grad-norm``, ``num-zeros``, ``params-norm``, ``loss-scale``, ``batch-size``, ``throughput``
(TFLOP/s per rank), ``tokens-per-second``, ``iteration-time`` (s), and memory (``mem-allocated-bytes``,
``mem-max-allocated-bytes``, ``mem-reserved-bytes`` on CUDA; ``mem-max-rss-bytes`` on CPU).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field

# JSONL key of a training record -> (TensorBoard tag, factor).
TENSORBOARD_TAGS = {
    "lm loss": ("lm loss", 1.0),
    "lr": ("learning-rate", 1.0),
    "grad_norm": ("grad-norm", 1.0),
    "loss_scale": ("loss-scale", 1.0),
    "tflops": ("throughput", 1.0),
    "tokens_per_s": ("tokens-per-second", 1.0),
    "elapsed_ms_per_iteration": ("iteration-time", 1e-3),
    "num_zeros_in_grad": ("num-zeros", 1.0),
    "params_norm": ("params-norm", 1.0),
}


def memory_stats() -> dict[str, int]:
    """This process's memory: the CUDA allocator's counters when CUDA is in use, else the
    peak resident set size."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "mem-allocated-bytes": torch.cuda.memory_allocated(),
            "mem-max-allocated-bytes": torch.cuda.max_memory_allocated(),
            "mem-reserved-bytes": torch.cuda.memory_reserved(),
        }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem-max-rss-bytes": peak if sys.platform == "darwin" else peak * 1024}


@dataclass(frozen=True)
class SSDShape:
    """What the Mamba-2 SSD scan's FLOPs depend on (global sizes of one mixer)."""

    heads: int
    head_dim: int
    state_dim: int
    groups: int
    chunk_size: int


def training_flops_per_token(
    matmul_params: int,
    num_attention_layers: int,
    seq_length: int,
    hidden_size: int,
    num_mamba_layers: int = 0,
    ssd: SSDShape | None = None,
    mla_channels: int = 0,
) -> float:
    """Forward + backward FLOPs per token: the one formula every TFLOP/s figure uses.

    - 6 per weight of every matrix the token passes through (attention and MLP projections,
      Mamba in/out projections and its depthwise conv, the output layer; not embedding lookups);
    - causal attention scores and context: 4*s*h per layer forward, halved by the mask, x3;
      multi-latent attention layers instead ``2*s*c`` forward, halved, x3, where ``mla_channels``
      sums their ``heads x (qk_head_dim + qk_pos_emb_head_dim + v_head_dim)``;
    - per Mamba layer, the SSD scan's matmuls (chunk length ``Q = min(chunk_size, s)``, ``H``
      heads of dim ``P``, state ``N``, ``G`` groups), forward per token: ``C B^T`` within the
      chunk ``2QNG`` and its product with ``x`` ``2QPH``, both halved by the causal mask as
      attention is, plus the chunk states ``B^T x`` and their readout ``C h`` ``2NPH`` each;
      x3 for forward + backward. Elementwise work (softplus, decays, gating, norms) is not counted.
    """
    flops = 6.0 * matmul_params + 6.0 * num_attention_layers * seq_length * hidden_size
    flops += 3.0 * seq_length * mla_channels
    if num_mamba_layers:
        q = min(ssd.chunk_size, seq_length)
        per_layer = q * ssd.state_dim * ssd.groups + q * ssd.head_dim * ssd.heads
        per_layer += 4 * ssd.state_dim * ssd.head_dim * ssd.heads
        flops += 3.0 * num_mamba_layers * per_layer
    return flops


@dataclass
class MetricsLogger:
    """Writes the periodic log line, JSONL records (--metrics-jsonl) and TensorBoard scalars."""

    enabled: bool
    jsonl_path: str | None = None
    tensorboard_dir: str | None = None
    print_fn: callable = field(default=lambda line: print(line, flush=True))
    _jsonl: object = field(default=None, init=False, repr=False)
    _writer: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.enabled:
            return
        if self.jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.jsonl_path)), exist_ok=True)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if self.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.tensorboard_dir)

    def _record(self, record: dict, step: int, scalars: dict[str, float]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for tag, value in scalars.items():
                if isinstance(value, (int, float)):
                    self._writer.add_scalar(tag, value, step)
            self._writer.flush()

    def log_training(
        self,
        *,
        iteration: int,
        train_iters: int,
        consumed_samples: int,
        elapsed_ms: float,
        tokens_per_s: float,
        tflops: float,
        lr: float,
        loss: float,
        grad_norm: float | None,
        skipped: int,
        nan: int,
        extra: dict | None = None,
        loss_scale: float | None = None,
        batch_size: int | None = None,
        num_zeros: int | None = None,
        params_norm: float | None = None,
    ) -> None:
        """One training record and Megatron's log line (its fields in its order and formats, plus
        tokens/s and TFLOP/s per rank)."""
        if not self.enabled:
            return
        record = {
            "type": "train",
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "lm loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "elapsed_ms_per_iteration": elapsed_ms,
            "tokens_per_s": tokens_per_s,
            "tflops": tflops,
            "skipped_iterations": skipped,
            "nan_iterations": nan,
        }
        for key, value in (("loss_scale", loss_scale), ("num_zeros_in_grad", num_zeros), ("params_norm", params_norm)):
            if value is not None:
                record[key] = value
        record.update(extra or {})
        scalars = {
            tag: record[key] * factor for key, (tag, factor) in TENSORBOARD_TAGS.items() if record.get(key) is not None
        }
        if batch_size is not None:
            scalars["batch-size"] = batch_size
        scalars.update({key: value for key, value in (extra or {}).items() if isinstance(value, (int, float))})
        scalars.update(memory_stats())
        self._record(record, iteration, scalars)
        grad = "n/a" if grad_norm is None else f"{grad_norm:.3f}"
        if num_zeros is not None:
            grad += f" | num zeros: {float(num_zeros):.1f}"
        if params_norm is not None:
            grad += f" | params norm: {params_norm:.3f}"
        batch = "" if batch_size is None else f" global batch size: {batch_size:5d} |"
        extras = "".join(f" {k}: {v:.6E} |" for k, v in (extra or {}).items() if isinstance(v, float))
        if loss_scale is not None:
            extras += f" loss scale: {loss_scale:.1f} |"
        self.print_fn(
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} | elapsed time per iteration (ms): {elapsed_ms:.1f} |"
            f" tokens/s: {tokens_per_s:.1f} | TFLOP/s: {tflops:.4f} | learning rate: {lr:.6E} |{batch}"
            f" lm loss: {loss:.6E} |{extras} grad norm: {grad} | number of skipped iterations: {skipped:3d} |"
            f" number of nan iterations: {nan:3d} |"
        )

    def log_evaluation(self, *, iteration: int, loss: float, label: str = "validation", final: bool = False) -> None:
        """Evaluation loss and perplexity as their own record and line. The line is Megatron's:
        ``validation loss at iteration N``, and for the evaluations after training
        (``final``) ``... at iteration N on validation set`` / ``on test set``."""
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss))
        self._record(
            {"type": label, "iteration": iteration, "lm loss": loss, "lm loss ppl": ppl},
            iteration,
            {f"lm loss {label}": loss, f"lm loss {label} ppl": ppl},
        )
        where = f"iteration {iteration} on {label} set" if final else f"iteration {iteration}"
        line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        bar = "-" * len(line)
        self.print_fn(f"{bar}\n{line}\n{bar}")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
