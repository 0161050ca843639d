"""The pretraining loop: build, train with periodic logs/eval/checkpoints, finish.

The entry points (``megatron-pretrain-gpt`` / ``megatron-pretrain-hybrid``, see
:mod:`megatron.training.entry`) only parse the flags; the model is built from the run's
model record (:func:`~megatron.training.arguments.model_record_from_args`) and this module
owns everything else. One log line and JSONL record per
``--log-interval`` comes from the logging rank (last pipeline stage, every other
coordinate 0), which holds the loss averaged over the whole global batch.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, fields
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import AsyncSaver, CheckpointingError, read_latest_iteration
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.model_record import adopt_untracked_checkpoints, model_chunks_from_record
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups import ProcessGroupCollection
from megatron.core.transformer.context_parallel import get_batch_on_this_cp_rank
from megatron.core.transformer.moe.router import aux_loss_metrics, set_aux_loss_scale, update_expert_biases
from megatron.training import startup_summary as summary
from megatron.training.arguments import model_record_from_args, optimizer_config_from_args, tokenizer_record_from_args
from megatron.training.checkpointing import rng_states, set_rng_states
from megatron.training.data import build_datasets, microbatches
from megatron.training.initialize import device_for, initialize_megatron
from megatron.training.metrics import MetricsLogger, SSDShape, training_flops_per_token
from megatron.training.result_validation import ResultValidator
from megatron.training.run_control import ExitRule, GarbageCollection, IterationProfiler, check_replica_weights
from megatron.training.startup_summary import parameter_counts_per_stage


@dataclass
class TrainState:
    """What a resumed run must restore besides weights and optimizer state: a few counters,
    saved in every checkpoint, so nothing here grows with the run. The loss curve is the
    metrics log's (``--metrics-jsonl``, one record per ``--log-interval``)."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0

    # Saved by earlier versions, no longer kept: ``history`` was the list of every iteration's loss.
    RETIRED_FIELDS: ClassVar[tuple[str, ...]] = ("history",)

    @classmethod
    def from_dict(cls, data: dict) -> TrainState:
        """The state a checkpoint's ``train_state`` holds (``dataclasses.asdict`` of one). Retired
        fields of older checkpoints are dropped; a missing field, or one this version does not
        know, raises CheckpointingError naming it."""
        known = [f.name for f in fields(cls)]
        missing = [name for name in known if name not in data]
        unknown = sorted(set(data) - set(known) - set(cls.RETIRED_FIELDS))
        if missing or unknown:
            raise CheckpointingError(
                f"the checkpoint's train state lacks {missing} and has unknown fields {unknown}; "
                f"this version reads {known}"
            )
        return cls(**{name: data[name] for name in known})


class IterationLog:
    """Bookkeeping after each training iteration, shared by the trainers: advances the
    TrainState and writes one record, averaged over the interval, every --log-interval
    iterations (and at the last one). ``extra_metrics`` (called on every rank at each record,
    e.g. the MoE losses averaged over the interval) adds named values to the record and line;
    ``params_norm`` (called on every rank at each record, with --log-params-norm) adds the
    parameters' global norm."""

    def __init__(
        self, args, logger: MetricsLogger, flops_per_token: float, num_ranks: int, extra_metrics=None, params_norm=None
    ):
        self.args, self.logger = args, logger
        self.flops_per_token, self.num_ranks = flops_per_token, num_ranks
        self.extra_metrics, self.params_norm = extra_metrics, params_norm
        self._losses: list[float] = []
        self._samples = 0  # since the last record
        self._start = time.perf_counter()

    def record(
        self,
        state: TrainState,
        loss: float,
        update_successful: bool,
        grad_norm: float | None,
        lr: float,
        loss_scale: float | None = None,
        num_zeros: int | None = None,
    ) -> None:
        """Advance ``state`` by one iteration; at a logging iteration, write the record (with
        this iteration's ``grad_norm`` and ``num_zeros``, as Megatron logs them)."""
        args = self.args
        batch = args.batch_schedule.batch_size(state.consumed_samples)
        state.iteration += 1
        state.consumed_samples += batch
        state.skipped_iterations += 0 if update_successful else 1
        state.nan_iterations += int(not math.isfinite(loss))
        self._losses.append(loss)
        self._samples += batch
        if state.iteration % args.log_interval and state.iteration != args.train_iters:
            return
        extra = self.extra_metrics() if self.extra_metrics is not None else None
        params_norm = self.params_norm() if self.params_norm is not None else None
        elapsed = time.perf_counter() - self._start
        iters = len(self._losses)
        tokens_per_s = self._samples * args.seq_length / elapsed
        self.logger.log_training(
            iteration=state.iteration,
            train_iters=args.train_iters,
            consumed_samples=state.consumed_samples,
            elapsed_ms=1000 * elapsed / iters,
            tokens_per_s=tokens_per_s,
            tflops=tokens_per_s * self.flops_per_token / 1e12 / self.num_ranks,
            lr=lr,
            loss=sum(self._losses) / iters,
            grad_norm=grad_norm,
            skipped=state.skipped_iterations,
            nan=state.nan_iterations,
            loss_scale=loss_scale,
            batch_size=batch,
            num_zeros=num_zeros,
            params_norm=params_norm,
            extra=extra,
        )
        self._losses, self._samples, self._start = [], 0, time.perf_counter()


def save_due(args, state: TrainState) -> bool:
    """Whether --save/--save-interval ask for a checkpoint after this iteration."""
    return bool(args.save) and (
        bool(args.save_interval and state.iteration % args.save_interval == 0) or state.iteration == args.train_iters
    )


def loss_func(
    loss_mask: torch.Tensor,
    output_tensor: torch.Tensor,
    per_token: bool = False,
    cp_group: dist.ProcessGroup | None = None,
):
    """The micro-batch's loss over its unmasked tokens: their mean, or with ``per_token``
    (``--calculate-per-token-loss``) their sum and count, the gradients being divided by the
    global batch's token count after the reduction (Megatron's per-token loss). The metric is
    the mean, or the (sum, count) pair.

    Under context parallelism (``cp_group``) each CP rank holds part of the micro-batch's tokens.
    Sums and counts simply add up over ``dp_cp``; the mean divides this rank's sum by the token
    count of the whole micro-batch (summed over ``cp``) and multiplies by the CP size, since
    gradients and the reported loss are averaged over ``dp_cp``: the CP ranks' terms then add
    up to the exact per-token mean."""
    total = (output_tensor.float() * loss_mask).sum()
    tokens = loss_mask.sum()
    if per_token:
        return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.detach()])}
    if cp_group is None:
        loss = total / tokens.clamp(min=1)
    else:
        dist.all_reduce(tokens, group=cp_group)
        loss = total * dist.get_world_size(cp_group) / tokens.clamp(min=1)
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model, per_token: bool = False, cp_group: dist.ProcessGroup | None = None):
    """One micro-batch through the model; the loss is computed on the last stage."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"], per_token=per_token, cp_group=cp_group)


def data_shard_rank(pgc: ProcessGroupCollection) -> int:
    """Which of the ``micro_batch_size``-sample slices of a step this rank reads: its index among
    the data shards of its ``dp_cp_gtp`` group. CP peers share a shard (each keeps its chunks of
    the sequences), so the index is that of the group's CP-rank-0 member with this rank's other
    coordinates; without CP it is this rank's index in the group."""
    layout, me = pgc.layout, dist.get_rank()
    (members,) = [group for group in layout.group_ranks("dp_cp_gtp") if me in group]
    readers = [rank for rank in members if layout.coordinates(rank)["cp"] == 0]
    return readers.index(layout.rank_of(layout.coordinates(me) | {"cp": 0}))


def logging_rank(pgc: ProcessGroupCollection) -> int:
    """The rank that prints and writes metrics: last pipeline stage, all other coordinates 0."""
    layout = pgc.layout
    return layout.rank_of({axis: 0 for axis in layout.axes} | {"pp": layout.pp - 1})


def count_flops_per_token(
    model: torch.nn.Module | list[torch.nn.Module],
    pgc: ProcessGroupCollection,
    seq_length: int,
    hidden_size: int,
    device: torch.device,
) -> float:
    """Training FLOPs per token of the whole model, summed over the model-parallel group:
    every matrix counted once (GTP shards summed, copies on other GTP peers skipped), input
    embedding lookups excluded, the (possibly tied) output layer included, plus attention and
    the Mamba scans (see :func:`training_flops_per_token`). Routed experts count as a token
    meets them: ``moe_router_topk`` whole experts per MoE layer (an expert's weights with its
    ``expt_tp`` shards, counted on TP rank 0), whatever EP holds here. ``model`` may be this
    rank's list of model chunks (virtual pipeline stages)."""
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mla import MLASelfAttention

    chunks = model if isinstance(model, list) else [model]
    first_replica = pgc.rank("gtp") == 0
    topk = chunks[0].config.moe_router_topk
    matmul = 0
    for chunk in chunks:
        output_weight = chunk.output_layer.weight if getattr(chunk, "output_layer", None) is not None else None
        for name, param in chunk.named_parameters():
            if param.dim() < 2 or (name.startswith("embedding.") and param is not output_weight):
                continue
            if getattr(param, "is_expert", False):
                if param.dim() == 3 and pgc.rank("tp") == 0:  # weights [experts, in, out]; not biases
                    shards = pgc.size("expt_tp") if getattr(param, "tensor_model_parallel", False) else 1
                    matmul += param[0].numel() * shards * topk
            elif (getattr(param, "gtp_sharded", False) or first_replica) and (
                getattr(param, "tensor_model_parallel", False) or pgc.rank("tp") == 0
            ):  # a weight whole on every TP rank (MLA's down-projections, routers) counts once
                matmul += param.numel()
    attention_layers = sum(isinstance(m, SelfAttention) for chunk in chunks for m in chunk.modules())
    mla_layers = sum(isinstance(m, MLASelfAttention) for chunk in chunks for m in chunk.modules())
    mixers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MambaMixer)]
    if pgc.rank("tp") != 0 or not first_replica:
        attention_layers, mla_layers, mixers = 0, 0, []
    counts = torch.tensor(
        [float(matmul), float(attention_layers), float(len(mixers)), float(mla_layers)], device=device
    )
    dist.all_reduce(counts, group=pgc.mp)
    config = chunks[0].config
    per_mla_layer = config.num_attention_heads * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim)
    ssd = SSDShape(
        config.mamba_num_heads,
        config.mamba_head_dim,
        config.mamba_state_dim,
        config.mamba_num_groups,
        config.mamba_chunk_size,
    )
    return training_flops_per_token(
        int(counts[0]), int(counts[1]), seq_length, hidden_size, int(counts[2]), ssd, int(counts[3]) * per_mla_layer
    )


def ddp_config_from_args(args) -> DistributedDataParallelConfig:
    """How the training flags ask gradients to be buffered, bucketed and reduced."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=(args.bf16 or args.fp16) and not args.grad_reduce_in_bf16,
        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
    )


def scheduler_from_args(optimizer, args) -> OptimizerParamScheduler:
    """The learning-rate and weight-decay schedule the training flags describe."""
    return OptimizerParamScheduler(
        optimizer,
        max_lr=args.lr,
        min_lr=args.min_lr,
        init_lr=args.lr_warmup_init,
        lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_iters=args.lr_decay_iters,
        lr_decay_style=args.lr_decay_style,
        weight_decay=args.weight_decay,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
    )


class Trainer:
    """Holds the model, optimizer, scheduler and data of one run and steps them. The model is
    built from ``self.record``, the run's model record, which its checkpoints store."""

    def __init__(self, args, pgc: ProcessGroupCollection):
        self.args = args
        self.pgc = pgc
        self.device = device_for(args)
        self.tokenizer = tokenizer_record_from_args(args).build()
        self.vocab_size = args.vocab_size or self.tokenizer.vocab_size
        self.record = model_record_from_args(args, self.vocab_size)
        chunks = model_chunks_from_record(
            self.record,
            pgc,
            args.virtual_pipeline_model_parallel_size,
            args.stage_ends,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        )
        chunks = [chunk.to(self.device) for chunk in chunks]
        for chunk in chunks:
            chunk.linear_cross_entropy = args.cross_entropy_fusion_impl == "linear"
            if args.use_torch_compile:
                chunk.decoder.compile_layers()
        self.config = chunks[0].config
        # One DDP wrapper per model chunk (virtual pipeline stage); ``model`` is the first.
        self.model_chunks = [
            DistributedDataParallel(self.config, ddp_config_from_args(args), chunk, pg_collection=pgc)
            for chunk in chunks
        ]
        self.model = self.model_chunks[0]
        self.optimizer = get_megatron_optimizer(optimizer_config_from_args(args), self.model_chunks, pgc)
        self.scheduler = scheduler_from_args(self.optimizer, args)
        self.state = TrainState()
        per_chunk = [parameter_counts_per_stage(chunk, pgc, self.device) for chunk in chunks]
        self.parameter_counts = [sum(counts) for counts in zip(*per_chunk, strict=True)]
        summary.print_model(args, self.parameter_counts)
        self.train_ds, self.valid_ds, self.test_ds = build_datasets(args, self.tokenizer, self.vocab_size)
        summary.print_datasets({"train": self.train_ds, "validation": self.valid_ds, "test": self.test_ds})
        self.is_logging_rank = dist.get_rank() == logging_rank(pgc)
        self.logger = MetricsLogger(self.is_logging_rank, args.metrics_jsonl, args.tensorboard_dir)
        self.flops_per_token = count_flops_per_token(chunks, pgc, args.seq_length, args.hidden_size, self.device)
        self.cp_group = pgc.cp if args.context_parallel_size > 1 else None
        self.forward_backward = get_forward_backward_func(
            args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
        )
        self.checkpoint_saver = AsyncSaver() if args.async_save and args.save else None
        holds_loss = pgc.rank("pp") == pgc.size("pp") - 1
        self.validator = ResultValidator(args, holds_loss, self.device)

    def data_iterator(self, dataset, start_sample: int, micro_batch_size: int | None = None):
        """The micro-batches (of ``micro_batch_size``, default --micro-batch-size) from
        ``start_sample`` on (under CP, this rank's load-balanced chunks of
        each sequence); with virtual stages, a list of one such iterator per model chunk (each chunk
        reads every micro-batch, as Megatron's do)."""

        def rank_batches():
            batches = microbatches(
                dataset,
                start_sample=start_sample,
                micro_batch_size=micro_batch_size or self.args.micro_batch_size,
                data_rank=data_shard_rank(self.pgc),
                data_width=self.args.data_parallel_width,
                device=self.device,
            )
            return (get_batch_on_this_cp_rank(batch, self.cp_group) for batch in batches)

        iterators = [rank_batches() for _ in self.model_chunks]
        return iterators[0] if len(iterators) == 1 else iterators

    def _run_schedule(
        self, data_iterator, forward_only: bool, num_microbatches: int, micro_batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward (and backward) over one global batch of ``num_microbatches`` micro-batches of
        ``micro_batch_size`` per data rank. Returns the loss over it on every rank of the last
        stage (the mean of the data group's micro-batch means; with per-token loss the global
        token mean), zero elsewhere, and with per-token loss this stage's token count (None
        otherwise)."""
        args = self.args
        per_token = args.calculate_per_token_loss
        seq = args.seq_length // args.context_parallel_size
        seq //= args.tensor_model_parallel_size if args.sequence_parallel else 1
        metrics, num_tokens = self.forward_backward(
            forward_step_func=partial(forward_step, per_token=per_token, cp_group=self.cp_group),
            data_iterator=data_iterator,
            model=self.model_chunks,
            num_microbatches=num_microbatches,
            microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_virtual_pipeline_stage,
            tensor_shape=(seq, micro_batch_size, args.hidden_size),
            dtype=self.config.params_dtype,
            device=self.device,
            forward_only=forward_only,
            pg_collection=self.pgc,
            grad_scale_func=None if forward_only else self.optimizer.scale_loss,
        )
        data_group = self.pgc.dp_cp_gtp_or_dp_cp()
        if per_token:
            tokens = torch.tensor(float(num_tokens), device=self.device)
            if not metrics:
                return torch.zeros((), device=self.device), tokens
            pair = torch.stack([m["lm loss"].float() for m in metrics]).sum(dim=0)
            dist.all_reduce(pair, group=data_group)
            return pair[0] / pair[1].clamp(min=1), tokens
        if not metrics:
            return torch.zeros((), device=self.device), None
        loss = torch.stack([m["lm loss"].float() for m in metrics]).mean()
        if dist.get_world_size(data_group) == 1:
            return loss, None
        dist.all_reduce(loss, group=data_group)
        return loss / dist.get_world_size(data_group), None

    def moe_loss_metrics(self) -> dict[str, float] | None:
        """The routers' load-balancing (and z-) losses since the last log, averaged over
        micro-batches, iterations, layers and the ranks that routed other tokens (Megatron's
        ``load_balancing_loss`` / ``z_loss``, divided by their coefficients); None without MoE."""
        if not self.config.num_moe_experts:
            return None
        return aux_loss_metrics(self.model_chunks, self.pgc.pp, [self.pgc.tp, self.pgc.dp_cp_gtp_or_dp_cp()])

    def train_step(self, data_iterator) -> tuple[float, bool, float | None, int | None]:
        """One iteration; returns (loss, update_successful, grad_norm, num_zeros_in_grad), the
        last None unless --log-num-zeros-in-grad. The forward and backward passes run as
        --rerun-mode says (:mod:`megatron.training.result_validation`)."""
        args = self.args
        start_sample = self.state.consumed_samples
        batch = args.batch_schedule.batch_size(start_sample)
        num_microbatches = batch // (args.micro_batch_size * args.data_parallel_width)
        start_rng = rng_states() if self.validator.mode != "disabled" else None  # what a re-run restores

        def forward_backward(again: bool):
            iterator = data_iterator
            if again:  # the same step once more: its RNG states and samples
                set_rng_states(start_rng)
                iterator = self.data_iterator(self.train_ds, start_sample)
            for chunk in self.model_chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            set_aux_loss_scale(self.optimizer.get_loss_scale(), num_microbatches, args.calculate_per_token_loss)
            return self._run_schedule(iterator, False, num_microbatches, args.micro_batch_size)

        def save_before_step():
            set_rng_states(start_rng)
            self.save_unless_saved()

        loss, num_tokens = self.validator.run_step(self.state.iteration + 1, forward_backward, save_before_step)
        finalize_model_grads(self.model_chunks, self.pgc, self.config, num_tokens=num_tokens)
        update_expert_biases(self.model_chunks, [self.pgc.tp, self.pgc.dp_cp_gtp_or_dp_cp()])
        update_successful, grad_norm, num_zeros = self.optimizer.step()
        if update_successful:  # the schedule counts samples, in iterations of the final batch (Megatron's)
            self.scheduler.step(1 if batch == args.global_batch_size else batch / args.global_batch_size)
        return loss.item(), update_successful, grad_norm, num_zeros

    @torch.no_grad()
    def evaluate(self, dataset=None) -> float:
        """Mean loss over --eval-iters batches of --eval-global-batch-size samples of ``dataset``
        (default: the validation split), always from its first sample."""
        args = self.args
        for chunk in self.model_chunks:
            chunk.eval()
        iterator = self.data_iterator(self.valid_ds if dataset is None else dataset, 0, args.eval_micro_batch_size)
        losses = [
            self._run_schedule(iterator, True, args.eval_num_microbatches, args.eval_micro_batch_size)[0].item()
            for _ in range(args.eval_iters)
        ]
        for chunk in self.model_chunks:
            chunk.train()
        if args.empty_unused_memory_level >= 2 and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return sum(losses) / len(losses)

    def _evaluate_and_log(self, dataset, label: str, gc_control: GarbageCollection, final: bool = False) -> None:
        with gc_control.around_evaluation():
            loss = self.evaluate(dataset)
        self.logger.log_evaluation(iteration=self.state.iteration, loss=loss, label=label, final=final)

    def train(self) -> TrainState:
        """Train to --train-iters (or until --exit-interval / --exit-duration-in-mins: save,
        then stop), evaluating every --eval-interval; after a full run, evaluate the
        validation and test splits (--eval-iters batches each), as Megatron does."""
        args, state = self.args, self.state
        iterator = self.data_iterator(self.train_ds, state.consumed_samples)
        log = IterationLog(
            args,
            self.logger,
            self.flops_per_token,
            dist.get_world_size(),
            extra_metrics=self.moe_loss_metrics,
            params_norm=self.optimizer.params_norm if args.log_params_norm else None,
        )
        gc_control = GarbageCollection(args.manual_gc, args.manual_gc_interval, args.manual_gc_eval)
        exit_signal = signal.Signals[args.exit_signal] if args.exit_signal_handler else None
        exit_rule = ExitRule(args.exit_interval, args.exit_duration_in_mins, self.device, exit_signal)
        profiler = IterationProfiler.from_args(args, self.device)
        exited = False
        while state.iteration < args.train_iters:
            if self.checkpoint_saver is not None:
                self.checkpoint_saver.poll()  # a failed background save stops training here
            profiler.before_step(state.iteration + 1)
            loss, ok, grad_norm, num_zeros = self.train_step(iterator)
            profiler.after_step(state.iteration + 1)
            if args.empty_unused_memory_level >= 1 and self.device.type == "cuda":
                torch.cuda.empty_cache()
            lr, loss_scale = self.scheduler.get_lr(), self.optimizer.get_loss_scale()
            log.record(state, loss, ok, grad_norm, lr, loss_scale, num_zeros)
            if state.iteration % args.log_interval == 0:
                report = self.validator.take_determinism_report()
                if report is not None and self.is_logging_rank:
                    print(f" iteration {state.iteration}: {report} (--rerun-mode report_stats)", flush=True)
            gc_control.after_step(state.iteration)
            evaluate = args.eval_interval and args.eval_iters and state.iteration % args.eval_interval == 0
            if evaluate and self.valid_ds is not None:
                self._evaluate_and_log(self.valid_ds, "validation", gc_control)
            interval = args.check_weight_hash_across_dp_replicas_interval
            if args.test_mode or (interval and state.iteration % interval == 0):
                self.finish_param_sync()  # overlapped gathers of the distributed optimizer land first
                flag = "--test-mode" if args.test_mode else "--check-weight-hash-across-dp-replicas-interval"
                check_replica_weights(self.model_chunks, self.pgc, state.iteration, flag, args.test_mode)
            saved = save_due(args, state)
            if saved:
                self.save()
            reason = exit_rule.reason(state.iteration)
            if reason is not None:
                if args.save and not saved:
                    self.save()
                if dist.get_rank() == 0:
                    print(f"exiting program {reason}", flush=True)
                exited = True
                break
        profiler.close()
        exit_rule.close()
        self.finish_param_sync()  # the last step's overlapped gathers
        if self.checkpoint_saver is not None:
            self.checkpoint_saver.close()  # the last checkpoint is complete before the run ends
        if not exited and args.eval_iters:
            for dataset, label in ((self.valid_ds, "validation"), (self.test_ds, "test")):
                if dataset is not None:
                    self._evaluate_and_log(dataset, label, gc_control, final=True)
        gc_control.close()
        return state

    def finish_param_sync(self) -> None:
        for chunk in self.model_chunks:
            chunk.finish_param_sync()

    def save(self) -> None:
        from megatron.training.checkpointing import save_checkpoint

        self.finish_param_sync()
        save_checkpoint(self)

    def save_unless_saved(self) -> None:
        """Save the current iteration unless --save already holds it (published checkpoints are
        never rewritten); the save is complete when this returns."""
        if self.checkpoint_saver is not None:
            self.checkpoint_saver.wait()  # a save in flight may be of this iteration
        if read_latest_iteration(self.args.save) != self.state.iteration:
            self.save()
            if self.checkpoint_saver is not None:
                self.checkpoint_saver.wait()

    def load(self) -> None:
        from megatron.training.checkpointing import load_checkpoint

        load_checkpoint(self)


def pretrain(args) -> TrainState:
    """Initialize, build the model the flags describe, (resume,) train and close. A --load
    directory without a checkpoint yet starts from scratch (Megatron's behaviour)."""
    pgc = initialize_megatron(args)
    summary.print_run(args, pgc)
    trainer = Trainer(args, pgc)
    if args.save:  # a save interrupted before its tracker moved: adopt it if complete (before --load reads it)
        adopt_untracked_checkpoints(args.save)
    if args.load and read_latest_iteration(args.load) is not None:
        trainer.load()
        trainer.validator.load_pending(args.load, trainer.state.iteration)
    elif args.load and dist.get_rank() == 0:
        print(f"--load {args.load}: no checkpoint there yet; training from scratch", flush=True)
    state = trainer.train()
    trainer.logger.close()
    return state
