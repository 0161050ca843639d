#!/usr/bin/env python3
"""Train a MIMO model (a GPT or hybrid language model + a small ViT) on generated images of
colored shapes captioned with their names. Launch with torchrun, e.g. on 6 CPU processes with
the encoder on ranks 0-1 and the language model (TP2 x DP2) on ranks 2-5:

    torchrun --nproc-per-node 6 examples/mimo/train_mimo.py --encoder-ranks first-2 \\
        --tensor-model-parallel-size 2 --encoder-tensor-model-parallel-size 1 \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 48 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 50 --lr 1e-3

Training, parallelism and checkpoint flags are those of examples/pretrain_gpt.py (they
describe the language model; --hybrid-layer-pattern makes it a HybridModel); the encoder
flags describe the encoder and where it runs. No global parallel state is used: each module
builds its own process groups, and checkpoints every module through them (--save,
--save-interval, --load, --finetune, --no-load-optim, --no-load-rng; a resumed run continues
exactly where the saved one was). The gradient-reduction flags (--overlap-grad-reduce,
--overlap-param-gather, --grad-reduce-in-bf16, --ddp-bucket-size) apply to every module; the
data, evaluation and run-control flags this example does not implement (UNSUPPORTED_FLAGS)
are refused; steps are not re-run to validate their results (--rerun-mode does not apply).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from megatron.core.config import TransformerConfig
from megatron.core.datasets.synthetic_image_caption import SyntheticImageCaptionDataset
from megatron.core.dist_checkpointing import iteration_dir, load, load_latest, save_iteration
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.mimo import (
    LANGUAGE_MODEL,
    MimoRoles,
    build_bridges,
    build_mimo_model,
    forward_backward,
    get_mimo_optimizer,
    image_submodule_provider,
    wrap_with_ddp,
)
from megatron.core.models.mimo.checkpointing import load_mimo_state, mimo_sharded_state_dict
from megatron.core.models.mimo.roles import data_index, data_width
from megatron.core.parallel_state import initialize_distributed
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.training.arguments import (
    ArgumentError,
    optimizer_config_from_args,
    parse_args,
    tokenizer_record_from_args,
    transformer_config_from_args,
)
from megatron.training.checkpointing import (
    rng_object,
    rng_states,
    scheduler_mismatch_policy,
    set_rng_states,
    train_state_object,
)
from megatron.training.data import microbatches
from megatron.training.initialize import configure_process, device_for
from megatron.training.metrics import MetricsLogger
from megatron.training.training import (
    IterationLog,
    TrainState,
    count_flops_per_token,
    ddp_config_from_args,
    save_due,
    scheduler_from_args,
)

IMAGES = "images"

# Flags of examples/pretrain_gpt.py that this example does not implement (flag -> why); given
# with a value other than the default, they are refused instead of being silently ignored.
_NOT_IMPLEMENTED = "the MIMO example does not implement it; train without it"
_GENERATED_DATA = "the MIMO example trains on generated image-caption samples; drop it"
UNSUPPORTED_FLAGS = {
    **dict.fromkeys(
        (
            "--mock-data",
            "--data-path",
            "--train-data-path",
            "--valid-data-path",
            "--test-data-path",
            "--split",
            "--data-cache-path",
            "--eod-mask-loss",
        ),
        _GENERATED_DATA,
    ),
    **dict.fromkeys(
        ("--eval-interval", "--eval-iters", "--eval-global-batch-size", "--eval-micro-batch-size"),
        "the MIMO example does not evaluate; drop it",
    ),
    **dict.fromkeys(
        (
            "--exit-interval",
            "--exit-duration-in-mins",
            "--exit-signal-handler",
            "--use-tp-pp-dp-mapping",
            "--check-weight-hash-across-dp-replicas-interval",
            "--manual-gc",
            "--manual-gc-interval",
            "--no-manual-gc-eval",
            "--empty-unused-memory-level",
            "--profile",
            "--use-torch-compile",
            "--log-params-norm",
            "--log-num-zeros-in-grad",
            "--step-batch-size-schedule",
            "--rampup-batch-size",
            "--decoupled-lr",
            "--decoupled-min-lr",
            "--num-distributed-optimizer-instances",
            "--test-mode",
            "--check-for-spiky-loss",
            "--error-injection-rate",
            "--result-rejected-tracker-filename",
        ),
        _NOT_IMPLEMENTED,
    ),
}


def add_mimo_args(parser: argparse.ArgumentParser) -> None:
    """The encoder's shape, layout and placement, and the image geometry."""
    g = parser.add_argument_group("mimo encoder")
    g.add_argument(
        "--encoder-ranks",
        default="colocated",
        help="'colocated' (the encoder on every rank) or 'first-N' (the encoder alone on ranks 0..N-1)",
    )
    g.add_argument("--encoder-tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--encoder-generalized-tensor-parallel-size", type=int, default=1)
    g.add_argument(
        "--encoder-data-parallel-size",
        type=int,
        default=None,
        help="default: whatever the encoder's ranks leave after TP x GTP",
    )
    g.add_argument("--encoder-num-layers", type=int, default=2)
    g.add_argument("--encoder-hidden-size", type=int, default=32)
    g.add_argument("--encoder-num-attention-heads", type=int, default=2)
    g.add_argument("--encoder-ffn-hidden-size", type=int, default=None)
    g.add_argument("--image-size", type=int, default=16)
    g.add_argument("--patch-size", type=int, default=4)


def language_world_size(encoder_ranks: str, world_size: int) -> int:
    """Ranks left to the language model by ``--encoder-ranks``."""
    if encoder_ranks == "colocated":
        return world_size
    count = encoder_ranks.removeprefix("first-")
    if not encoder_ranks.startswith("first-") or not count.isdigit() or not 0 < int(count) < world_size:
        raise ArgumentError(
            f"--encoder-ranks must be 'colocated' or 'first-N' with 0 < N < world size {world_size}, "
            f"got {encoder_ranks!r}"
        )
    return world_size - int(count)


def parse_mimo_args(argv: list[str] | None = None, world_size: int | None = None) -> argparse.Namespace:
    """Megatron's flags (validated against the language model's ranks) plus the MIMO flags."""
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    known = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    known.add_argument("--encoder-ranks", default="colocated")
    known.add_argument("--hybrid-layer-pattern", default=None)
    pre, _ = known.parse_known_args(argv)
    family = "hybrid" if pre.hybrid_layer_pattern else "gpt"
    args = parse_args(
        argv,
        model_family=family,
        world_size=language_world_size(pre.encoder_ranks, world_size),
        extra_args_provider=add_mimo_args,
    )
    given = [flag for flag in UNSUPPORTED_FLAGS if flag in args.non_default_args]
    if given:
        raise ArgumentError("; ".join(f"{flag}: {UNSUPPORTED_FLAGS[flag]}" for flag in given))
    checks = [
        (args.pipeline_model_parallel_size == 1, "--pipeline-model-parallel-size must be 1 for MIMO models"),
        (not args.calculate_per_token_loss, "--calculate-per-token-loss is not supported for MIMO models"),
        (args.optimizer != "muon", "--optimizer muon: the MIMO example steps its modules with adam or sgd"),
        (
            args.image_size % args.patch_size == 0,
            f"--image-size ({args.image_size}) must be a multiple of --patch-size ({args.patch_size})",
        ),
        (
            args.encoder_num_attention_heads % args.encoder_tensor_model_parallel_size == 0,
            f"--encoder-num-attention-heads ({args.encoder_num_attention_heads}) must be divisible by "
            f"--encoder-tensor-model-parallel-size ({args.encoder_tensor_model_parallel_size})",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ArgumentError(message)
    args.world_size = world_size
    return args


def encoder_config_from_args(args) -> TransformerConfig:
    """The ViT's configuration: its own sizes and layout, the language model's numerics, and
    an init seed of its own (its layers must not copy the language model's)."""
    return TransformerConfig(
        num_layers=args.encoder_num_layers,
        hidden_size=args.encoder_hidden_size,
        num_attention_heads=args.encoder_num_attention_heads,
        ffn_hidden_size=args.encoder_ffn_hidden_size,
        tensor_model_parallel_size=args.encoder_tensor_model_parallel_size,
        generalized_tensor_parallel_size=args.encoder_generalized_tensor_parallel_size,
        bf16=args.bf16,
        fp16=args.fp16,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        init_method_std=args.init_method_std,
        init_seed=args.seed + 1,
    )


def language_model_provider(args, config: TransformerConfig, vocab_size: int):
    """A single-stage GPTModel or HybridModel whose embedding is not scattered (the modality
    embeddings are placed before the sequence-parallel scatter)."""
    common = dict(
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        scatter_embedding_sequence_parallel=False,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
    )

    def provide(pg_collection):
        if args.model_family == "hybrid":
            from megatron.core.models.hybrid import HybridModel, get_hybrid_stack_local_spec

            return HybridModel(
                config,
                get_hybrid_stack_local_spec(),
                vocab_size,
                args.max_position_embeddings,
                hybrid_layer_pattern=args.hybrid_layer_pattern,
                pg_collection=pg_collection,
                **common,
            )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size,
            args.max_position_embeddings,
            pg_collection=pg_collection,
            **common,
        )

    return provide


class MimoTrainer:
    """This rank's modules, optimizer chain, scheduler and data; steps them in lockstep with
    the other ranks of the job."""

    def __init__(self, args):
        self.args = args
        self.device = device_for(args)
        self.roles = MimoRoles.build(
            args.world_size,
            language={"tp": args.tensor_model_parallel_size, "gtp": args.generalized_tensor_parallel_size},
            modalities={
                IMAGES: {
                    "tp": args.encoder_tensor_model_parallel_size,
                    "gtp": args.encoder_generalized_tensor_parallel_size,
                }
                | ({"dp": args.encoder_data_parallel_size} if args.encoder_data_parallel_size else {})
            },
            placement=args.encoder_ranks,
        )
        self.collections = self.roles.build_collections(backend=args.distributed_backend)
        torch.manual_seed(args.seed)
        model_parallel_manual_seed(args.seed, next(iter(self.collections.values())))
        self.tokenizer = tokenizer_record_from_args(args).build()
        self.image_token_id = self.tokenizer.vocab_size
        language_config = transformer_config_from_args(args)
        encoder_config = encoder_config_from_args(args)
        self.num_image_tokens = (args.image_size // args.patch_size) ** 2
        self.model = build_mimo_model(
            self.collections,
            language_model_provider(args, language_config, self.tokenizer.vocab_size + 1),
            {IMAGES: image_submodule_provider(encoder_config, args.image_size, args.patch_size, args.hidden_size)},
            {IMAGES: self.image_token_id},
        ).to(self.device)
        self.ddp = wrap_with_ddp(self.model, self.collections, ddp_config_from_args(args))
        self.optimizer = get_mimo_optimizer(
            optimizer_config_from_args(args),
            self.ddp,
            self.collections,
            [LANGUAGE_MODEL, *self.roles.modality_names],
        )
        self.scheduler = scheduler_from_args(self.optimizer, args)
        self.bridges = build_bridges(
            self.roles,
            args.micro_batch_size,
            {IMAGES: (self.num_image_tokens, args.hidden_size)},
            dtype=language_config.params_dtype,
            device=self.device,
        )
        self.train_ds = SyntheticImageCaptionDataset(
            args.train_iters * args.global_batch_size,
            args.seq_length,
            args.image_size,
            self.num_image_tokens,
            self.tokenizer,
            self.image_token_id,
            args.seed,
        )
        language_layout = self.roles.layouts[LANGUAGE_MODEL]
        self.logging_rank = language_layout.rank_of({axis: 0 for axis in language_layout.axes})
        self.logger = MetricsLogger(dist.get_rank() == self.logging_rank, args.metrics_jsonl, args.tensorboard_dir)
        # Language-model FLOPs only (the encoder's are not counted), known on its ranks.
        self.flops_per_token = 0.0
        if self.model.language_model is not None:
            self.flops_per_token = count_flops_per_token(
                self.model.language_model,
                self.collections[LANGUAGE_MODEL],
                args.seq_length,
                args.hidden_size,
                self.device,
            )
        self.state = TrainState()

    def iterators(self, start_sample: int):
        """This rank's language-model batches (or None) and per-modality batches."""
        me = dist.get_rank()
        batches = {}
        for name in self.roles.modules_on(me):
            layout = self.roles.layouts[name]
            bridge = self.bridges[IMAGES]
            size = bridge.language_micro_batch_size if name == LANGUAGE_MODEL else bridge.encoder_micro_batch_size
            batches[name] = microbatches(
                self.train_ds,
                start_sample=start_sample,
                micro_batch_size=size,
                data_rank=data_index(layout, me),
                data_width=data_width(layout),
                device=self.device,
            )
        return batches.pop(LANGUAGE_MODEL, None), batches

    def _job_loss(self, losses: list[torch.Tensor]) -> float:
        """The global batch's mean loss, known on every rank of the job."""
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            group = self.collections[LANGUAGE_MODEL].dp_cp_gtp_or_dp_cp()
            loss = torch.stack(losses).mean()
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        dist.broadcast(loss, src=self.logging_rank)
        return loss.item()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them, in every module this rank holds."""
        with contextlib.ExitStack() as stack:
            for module in self.ddp.values():
                stack.enter_context(module.no_sync())
            yield

    def finish_param_sync(self) -> None:
        """Wait for the parameter gathers still in flight (--overlap-param-gather)."""
        for module in self.ddp.values():
            module.finish_param_sync()

    def train_step(self, language_batches, modality_batches) -> tuple[float, bool, float | None]:
        """One iteration; returns (loss, update_successful, grad_norm), the same on every rank."""
        for module in self.ddp.values():
            module.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = forward_backward(
            self.model,
            self.bridges,
            language_batches,
            modality_batches,
            self.args.num_microbatches,
            grad_scale_func=self.optimizer.scale_loss,
            no_sync=self.no_sync,
        )
        for name, module in self.ddp.items():
            finalize_model_grads([module], self.collections[name], module.config)
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(1)
        return self._job_loss(losses), update_successful, grad_norm

    def train(self) -> TrainState:
        args, state = self.args, self.state
        language_batches, modality_batches = self.iterators(state.consumed_samples)
        log = IterationLog(args, self.logger, self.flops_per_token, len(self.roles.layouts[LANGUAGE_MODEL].ranks))
        while state.iteration < args.train_iters:
            loss, ok, grad_norm = self.train_step(language_batches, modality_batches)
            log.record(state, loss, ok, grad_norm, self.scheduler.get_lr())
            if save_due(args, state):
                self.save()
        self.finish_param_sync()
        return state

    def layouts(self) -> dict[str, dict]:
        """Every module's grid, as saved with a checkpoint (RNG states only restore under the same)."""
        return {name: dataclasses.asdict(layout) for name, layout in self.roles.layouts.items()}

    def save(self) -> str:
        """Save every module's weights and optimizer state (each through its own groups), the
        LR schedule, the train state and every rank's RNG states as ``--save``/iter_<iteration>."""
        self.finish_param_sync()
        state = mimo_sharded_state_dict(self.model, self.collections, self.optimizer) | {
            "train_state": train_state_object(dataclasses.asdict(self.state), dist.get_rank() == self.logging_rank),
            "rng_state": rng_object(rng_states()),
            "scheduler": self.scheduler.state_dict(),
            "layouts": self.layouts(),
        }
        path = save_iteration(
            state, self.args.save, self.state.iteration, retain_interval=self.args.save_retain_interval
        )
        if dist.get_rank() == self.logging_rank:
            print(f"saved checkpoint {path} (iteration {self.state.iteration})", flush=True)
        return path

    def load(self) -> None:
        """Resume from the iteration ``--load``'s tracker names: the weights always; unless
        ``--finetune`` also the train state and LR schedule, the optimizer state (unless
        ``--no-load-optim``) and the RNG states (unless ``--no-load-rng`` or the layouts changed)."""
        args = self.args
        common, iteration = load_latest({}, args.load)
        resume = not args.finetune
        optimizer = self.optimizer if resume and not args.no_load_optim else None
        with_rng = resume and not args.no_load_rng and common.get("layouts") == self.layouts()
        request = mimo_sharded_state_dict(self.model, self.collections, optimizer)
        if resume:
            request["train_state"] = train_state_object(None, True)
        if with_rng:
            request["rng_state"] = rng_object(None)
        loaded = load(request, iteration_dir(args.load, iteration))
        load_mimo_state(self.model, loaded, optimizer)
        parts = ["model weights"]
        if optimizer is None:
            self.optimizer.reload_model_params()
        else:
            parts.append("optimizer state")
        if resume:
            self.state = TrainState.from_dict(loaded["train_state"])
            self.scheduler.load_state_dict(common["scheduler"], on_mismatch=scheduler_mismatch_policy(args))
            parts.append(
                f"train state (iteration {self.state.iteration}, consumed samples "
                f"{self.state.consumed_samples}), LR schedule"
            )
        if with_rng:
            set_rng_states(loaded["rng_state"])
            parts.append("RNG states")
        if dist.get_rank() == self.logging_rank:
            print(f"loaded checkpoint {iteration_dir(args.load, iteration)}: " + ", ".join(parts), flush=True)


def train(args) -> TrainState:
    """Join the job, build this rank's part (resumed from --load when given), train and close the logger."""
    configure_process(args)
    initialize_distributed(args.distributed_backend, args.distributed_timeout_minutes)
    trainer = MimoTrainer(args)
    if args.load:
        trainer.load()
    state = trainer.train()
    trainer.logger.close()
    return state


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_mimo_args(argv)
    except ArgumentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    train(args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
