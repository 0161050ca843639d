"""Training logs: Megatron-style log lines, JSONL metric records, TensorBoard scalars.

Only the last pipeline stage's data-parallel rank 0 holds the loss; callers pass every
record through :class:`MetricsLogger` on that rank (``enabled=True``), which is the one
that writes.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field


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
) -> float:
    """Forward + backward FLOPs per token: the one formula every TFLOP/s figure uses.

    - 6 per weight of every matrix the token passes through (attention and MLP projections,
      Mamba in/out projections and its depthwise conv, the output layer; not embedding lookups);
    - causal attention scores and context: 4*s*h per layer forward, halved by the mask, x3;
    - per Mamba layer, the SSD scan's matmuls (chunk length ``Q = min(chunk_size, s)``, ``H``
      heads of dim ``P``, state ``N``, ``G`` groups), forward per token: ``C B^T`` within the
      chunk ``2QNG`` and its product with ``x`` ``2QPH``, both halved by the causal mask as
      attention is, plus the chunk states ``B^T x`` and their readout ``C h`` ``2NPH`` each;
      x3 for forward + backward. Elementwise work (softplus, decays, gating, norms) is not counted.
    """
    flops = 6.0 * matmul_params + 6.0 * num_attention_layers * seq_length * hidden_size
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

    def _record(self, record: dict, step: int) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key not in ("iteration", "type") and isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)
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
    ) -> None:
        """One training record and Megatron's log line."""
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
        record.update(extra or {})
        self._record(record, iteration)
        grad = "n/a" if grad_norm is None else f"{grad_norm:.3E}"
        extras = "".join(f" {k}: {v:.6E} |" for k, v in (extra or {}).items() if isinstance(v, float))
        self.print_fn(
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} | elapsed time per iteration (ms): {elapsed_ms:.1f} |"
            f" tokens/s: {tokens_per_s:.1f} | TFLOP/s: {tflops:.4f} | learning rate: {lr:.6E} |"
            f" lm loss: {loss:.6E} |{extras} grad norm: {grad} | number of skipped iterations: {skipped:3d} |"
            f" number of nan iterations: {nan:3d} |"
        )

    def log_evaluation(self, *, iteration: int, loss: float, label: str = "validation") -> None:
        """Evaluation loss and perplexity as their own record and line."""
        if not self.enabled:
            return
        ppl = math.exp(min(20.0, loss))
        self._record({"type": label, "iteration": iteration, "lm loss": loss, "lm loss ppl": ppl}, iteration)
        line = f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
        bar = "-" * len(line)
        self.print_fn(f"{bar}\n{line}\n{bar}")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
