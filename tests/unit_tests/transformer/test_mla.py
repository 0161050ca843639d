"""Multi-latent attention through the training loop: TP2, TP2 with sequence parallelism, the
distributed optimizer and CP2 (ring and all-gather) train the single-process curve, a checkpoint
resumes under another layout, the features MLA does not run with are refused, and the inference
engine generates what full forwards generate. (Its logits equal HF DeepSeek-V3's through the
mapping: tests/unit_tests/models/gpt/test_hf_mapping.py.)"""

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.training.arguments import ArgumentError
from tests.unit_tests.dist_harness import run_distributed
from tests.unit_tests.training.loss_curve import loss_curve, losses_by_iteration
from tests.unit_tests.training.tiny_training import CURVE_RUN, tiny_args, train_tiny

RUN = [*CURVE_RUN, "--num-layers", "2", "--eval-iters", "0", "--log-interval", "1", "--train-iters", "4"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "8"]
MLA += ["--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--position-embedding-type", "rope"]
MLA += ["--rotary-scaling-factor", "4", "--mscale", "1.3", "--mscale-all-dim", "0.7"]
MLA += ["--yarn-original-max-position-embeddings", "8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("mla") / "single.jsonl"
    run_distributed(train_tiny, 1, RUN + MLA, "gpt", 1, path)
    return loss_curve(path)


@pytest.mark.parametrize(
    "layout",
    [
        ["--tensor-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--use-distributed-optimizer"],
    ],
    ids=["tp2", "tp2-sp", "dp2-distributed-optimizer"],
)
def test_layouts_train_the_single_process_curve(reference, layout, tmp_path):
    run_distributed(train_tiny, 2, RUN + MLA + layout, "gpt", 2, tmp_path / "m.jsonl")
    assert loss_curve(tmp_path / "m.jsonl") == pytest.approx(reference, rel=1e-5)
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_context_parallel_trains_the_single_process_curve(comm, tmp_path):
    """Under CP the ring sends keys and values together, so both are padded to one head size
    (values of 8 channels here, keys of 12): CP2 trains the CP1 curve."""
    flags = RUN + MLA + ["--v-head-dim", "8", "--attention-dropout", "0"]
    run_distributed(train_tiny, 1, flags, "gpt", 1, tmp_path / "cp1.jsonl")
    cp2 = flags + ["--context-parallel-size", "2", "--cp-comm-type", comm]
    run_distributed(train_tiny, 2, cp2, "gpt", 2, tmp_path / "cp2.jsonl")
    reference = loss_curve(tmp_path / "cp1.jsonl")
    assert loss_curve(tmp_path / "cp2.jsonl") == pytest.approx(reference, rel=1e-5)
    assert reference[-1] < reference[0]


def test_a_checkpoint_resumes_without_model_flags_under_tp2(reference, tmp_path):
    save = str(tmp_path / "ckpt")
    first = RUN[:-1] + ["2", "--lr-decay-iters", "4", "--save", save] + MLA
    run_distributed(train_tiny, 1, first, "gpt", 1, None)
    resumed = RUN + ["--load", save, "--tensor-model-parallel-size", "2"]
    run_distributed(train_tiny, 2, resumed, "gpt", 2, tmp_path / "b.jsonl")
    losses = losses_by_iteration(tmp_path / "b.jsonl")
    assert [losses[3], losses[4]] == pytest.approx(reference[2:], rel=1e-5)


def test_megatron_takes_yarn_for_mla_by_default():
    args = tiny_args(RUN + MLA)
    assert args.position_embedding_type == "yarn"
    plain = tiny_args(RUN + MLA + ["--rope-type", "rope"])
    assert plain.position_embedding_type == "rope"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-query-groups", "2"], "needs num_query_groups == num_attention_heads"),
    ],
)
def test_what_mla_does_not_run_with_is_refused(flags, message):
    with pytest.raises(ArgumentError, match=message):
        tiny_args(RUN + MLA + flags, world_size=2)


def _engine_and_full_forward_greedy(tp: int):
    """Greedy tokens of the inference engine (paged cache, chunked prefill) and of full forwards
    without a cache, for a model trained here (YaRN, values narrower than keys) at TP ``tp``."""
    from megatron.core import parallel_state
    from megatron.core.models.model_record import model_from_record
    from megatron.training.arguments import model_record_from_args
    from tests.unit_tests.inference.engines.test_hf_generate import PROMPT_LENGTHS, _engine_greedy, prompts

    pg = parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    flags = RUN + MLA + ["--v-head-dim", "8", "--tensor-model-parallel-size", str(tp)]
    model = model_from_record(model_record_from_args(tiny_args(flags, world_size=tp), 128), pg, parallel_output=False)
    engine_tokens = _engine_greedy(model.eval(), pg)
    full = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts(PROMPT_LENGTHS), engine_tokens, strict=True):
            ids = list(prompt)
            for _ in tokens:
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            full.append(ids[len(prompt) :])
    return engine_tokens, full


@pytest.mark.parametrize("tp", [1, 2])
def test_the_inference_engine_generates_what_full_forwards_generate(tp):
    """The engine's paged cache holds every head's key and value at one head size (the values
    zero-padded here); its greedy tokens equal full forwards' without a cache, also under TP."""
    results = run_distributed(_engine_and_full_forward_greedy, tp, tp)
    for engine_tokens, full in results:
        assert engine_tokens == full and all(engine_tokens)
    assert all(result == results[0] for result in results)


def test_odd_rotary_channels_are_refused():
    with pytest.raises(ConfigError, match="an even qk_pos_emb_head_dim"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, multi_latent_attention=True,
                          qk_pos_emb_head_dim=3)  # fmt: skip


def _flops(tp):
    from megatron.core import parallel_state
    from megatron.core.models.model_record import model_from_record
    from megatron.training.arguments import model_record_from_args
    from megatron.training.training import count_flops_per_token

    args = tiny_args(RUN + MLA + ["--tensor-model-parallel-size", str(tp)], world_size=tp)
    pg = parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model = model_from_record(model_record_from_args(args, 256), pg)  # no padding at TP1 or TP2
    return count_flops_per_token(model, pg, 16, args.hidden_size, torch.device("cpu"))


def test_flops_count_the_latent_projections_and_the_narrower_attention():
    """6 per matrix weight (per layer: q down 24x32, q up 24x48, kv down 32x20, kv up 16x80,
    output 48x32, fc1 32x128 (4h), fc2 128x32; the output layer 256x32), plus per MLA layer
    3 * s * heads * (qk + rotated + v) = 3 * 16 * 4 * 24, the same under TP2."""
    h, vocab = 32, 256
    per_layer = 32 * 24 + 24 * 48 + 32 * 20 + 16 * 80 + 48 * 32 + 2 * 4 * h * h
    want = 6 * (2 * per_layer + vocab * h) + 2 * 3 * 16 * 4 * 24
    assert run_distributed(_flops, 1, 1) == [want]
    assert run_distributed(_flops, 2, 2) == [want, want]
