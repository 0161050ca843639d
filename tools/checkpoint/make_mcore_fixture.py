"""Write the megatron-core ``torch_dist`` fixture that ``megatron-convert --loader mcore`` is tested on.

Runs megatron-core (the PyPI package ``megatron-core==0.19.2``, NOT this repository's package of
the same import name) in one CPU process (gloo, fp32, TF32 off): a tiny Llama-style GPTModel with
the local spec (RMSNorm, SwiGLU, GQA, RoPE, untied output layer) and seeded random weights is
saved with megatron-core's own ``dist_checkpointing.save`` (torch_dist), with the logits it gives
for fixed token ids beside it. Because the import name clashes with ours, run it with only the
megatron-core install on the path and from outside this repository, e.g.::

    pip download megatron-core==0.19.2 --no-deps -d /tmp/mcore_wheel
    mkdir /tmp/mcore && (cd /tmp/mcore && unzip -q /tmp/mcore_wheel/megatron_core-0.19.2-*.whl)
    cd /tmp && PYTHONPATH=/tmp/mcore python /path/to/tools/checkpoint/make_mcore_fixture.py OUT_DIR

(megatron-core needs torch, numpy and packaging; its only compiled module is a dataset helper
this script does not use, so the cp312 wheel's Python files also run under Python 3.11.)
OUT_DIR receives ``checkpoint/`` (the torch_dist directory), ``logits.pt`` (a plain tensor:
``torch.load(..., weights_only=True)``) and ``fixture.json`` (the model's shape, the token ids
and the package version).
"""

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

CONFIG = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 96,
    "normalization": "RMSNorm",
    "layernorm_epsilon": 1e-5,
    "gated_linear_unit": True,
    "add_bias_linear": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}
VOCAB_SIZE, MAX_SEQUENCE_LENGTH, ROTARY_BASE = 128, 64, 10000
TOKEN_IDS = [[3, 17, 99, 42, 5, 127, 64, 8, 1, 77, 23, 51], [0, 11, 12, 13, 14, 15, 90, 91, 92, 2, 4, 6]]


def megatron_lm_args() -> argparse.Namespace:
    """The model arguments of a Megatron-LM run that builds this model (its flag names)."""
    return argparse.Namespace(
        num_layers=CONFIG["num_layers"],
        hidden_size=CONFIG["hidden_size"],
        ffn_hidden_size=CONFIG["ffn_hidden_size"],
        num_attention_heads=CONFIG["num_attention_heads"],
        group_query_attention=True,
        num_query_groups=CONFIG["num_query_groups"],
        kv_channels=CONFIG["hidden_size"] // CONFIG["num_attention_heads"],
        normalization=CONFIG["normalization"],
        norm_epsilon=CONFIG["layernorm_epsilon"],
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        apply_layernorm_1p=False,
        qk_layernorm=False,
        position_embedding_type="rope",
        rotary_base=ROTARY_BASE,
        rotary_percent=1.0,
        use_rope_scaling=False,
        untie_embeddings_and_output_weights=True,
        padded_vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_SEQUENCE_LENGTH,
        seq_length=MAX_SEQUENCE_LENGTH,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        transformer_impl="local",
        params_dtype=torch.float32,
    )


def main(out_dir: str) -> None:
    import megatron.core
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "site-packages" not in megatron.core.__file__ and os.path.isfile(
        os.path.join(os.path.dirname(megatron.core.__file__), "models", "model_record.py")
    ):
        raise SystemExit(f"this imported the repository's megatron ({megatron.core.__file__}), not megatron-core")
    # megatron-core moves RoPE's inverse frequencies to torch.cuda.current_device() on first use;
    # the fixture is computed on CPU (also on a GPU machine), so that device is the CPU.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None  # its checkpoint writer syncs before copying tensors
    # Its attention forks the CUDA RNG tracker around dropout; dropout is 0 here, so no RNG state is needed.
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    # --swiglu: gated_linear_unit with silu (megatron-core's default activation is gelu)
    config = TransformerConfig(
        **CONFIG, activation_func=F.silu, use_cpu_initialization=True, params_dtype=torch.float32
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        position_embedding_type="rope",
        rotary_base=ROTARY_BASE,
        share_embeddings_and_output_weights=False,
    ).eval()
    with torch.no_grad():  # norms start at ones: make every weight non-trivial
        generator = torch.Generator().manual_seed(5)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    ids = torch.tensor(TOKEN_IDS)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    # megatron-core's default causal mask is built on "cuda": pass it (True = masked out)
    causal_mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=causal_mask)
    os.makedirs(os.path.join(out_dir, "checkpoint"), exist_ok=True)
    # What Megatron-LM's training loop saves besides the model: its arguments, the iteration and
    # the checkpoint version (kept in the checkpoint's common state).
    state = {"model": model.sharded_state_dict(), "args": megatron_lm_args(), "iteration": 7, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, os.path.join(out_dir, "checkpoint"))
    torch.save(logits.contiguous(), os.path.join(out_dir, "logits.pt"))
    with open(os.path.join(out_dir, "fixture.json"), "w") as f:
        json.dump(
            {
                "megatron_core_version": megatron.core.__version__,
                "config": CONFIG,
                "vocab_size": VOCAB_SIZE,
                "max_sequence_length": MAX_SEQUENCE_LENGTH,
                "rotary_base": ROTARY_BASE,
                "token_ids": TOKEN_IDS,
            },
            f,
            indent=1,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ["OUT"])
