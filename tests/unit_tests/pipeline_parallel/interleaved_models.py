"""GPT and hybrid models split into virtual pipeline stages, run through the schedule for one
global batch: each rank's losses and gradients keyed by checkpoint key (global layer numbers),
so any layout compares with the single-process run. Shared by the tests of every world size."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.config import TransformerConfig
from megatron.core.dist_checkpointing.model_state import checkpoint_params
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.model_record import ModelRecord, model_chunks_from_record
from megatron.core.pipeline_parallel import get_forward_backward_func

SEQ, MBS, HIDDEN, VOCAB = 8, 2, 32, 64
RECORDS = {
    # MTP and tied embeddings: the last virtual stage holds the output layer, MTP and a copy of the embedding.
    "gpt": ModelRecord(
        family="gpt",
        config=TransformerConfig(
            num_layers=8, hidden_size=HIDDEN, num_attention_heads=4, init_seed=3, mtp_num_layers=1
        ),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
    ),
    "hybrid": ModelRecord(
        family="hybrid",
        config=TransformerConfig(
            num_layers=8, hidden_size=HIDDEN, num_attention_heads=4, init_seed=3, mamba_head_dim=8, mamba_state_dim=8
        ),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        layer_pattern="M*|M-|*M|-M",
    ),
}


def _batches(num_microbatches):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (num_microbatches, MBS, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).expand(MBS, SEQ)
    return [(t[:, :-1], positions, t[:, 1:]) for t in tokens]


def _forward_step(data_iterator, model):
    tokens, positions, labels = next(data_iterator)
    output = model(tokens, positions, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach().item()}

    return output, loss_func


def losses_and_grads(family, pp, vp, num_microbatches):
    """This rank's (losses, {checkpoint key: gradient}) after one global batch on PP x V."""
    pgc = parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    chunks = model_chunks_from_record(RECORDS[family], pgc, vp)
    batches = _batches(num_microbatches)
    metrics, _ = get_forward_backward_func(pp, vp)(
        forward_step_func=_forward_step,
        data_iterator=[iter(batches) for _ in chunks] if vp else iter(batches),
        model=chunks,
        num_microbatches=num_microbatches,
        tensor_shape=(SEQ, MBS, HIDDEN),
        pg_collection=pgc,
    )
    finalize_model_grads(chunks, pgc)  # sums the tied embedding copies' gradients
    grads = {spec.key: spec.param.grad.clone() for chunk in chunks for spec in checkpoint_params(chunk)}
    return [m["loss"] for m in metrics], grads


def check_layout_matches_single_process(reference, results):
    """Every rank's gradients (together: each key once, copies equal) and the last stage's
    losses equal the single-process ones."""
    ref_losses, ref_grads = reference
    gathered = {}
    for _, grads in results:
        for key, grad in grads.items():
            if key in gathered:
                torch.testing.assert_close(grad, gathered[key], rtol=0, atol=0)
            gathered[key] = grad
    assert sorted(gathered) == sorted(ref_grads)
    for key, grad in gathered.items():
        torch.testing.assert_close(grad, ref_grads[key], rtol=1e-5, atol=1e-6, msg=key)
    assert results[-1][0] == pytest.approx(ref_losses, rel=1e-5)
