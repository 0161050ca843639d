"""The Mamba mixer's inference step over a dynamic context's packed batch:

- the Triton recurrence (conv + SSM over the request slots, in place) equals the torch
  token-by-token path on steps mixing prefill chunks and decode tokens, leaves slots outside the
  step untouched (NaN there stays there and never leaks), and is bitwise split invariant: a
  request's outputs and final state are the same computed in one prefill or in several chunks
  and decode tokens next to other requests;
- the batch-variant mode prefills with the chunked scan from each request's state (conv state
  from the prompt tail), equal to the token-by-token path to fp32 rounding, a request prefilled
  in pieces carrying its state between them.

Without CUDA the Triton kernels run under Triton's interpreter on CPU tensors.
"""

import pytest
import torch

from megatron.core.inference.contexts import Capacity, DynamicInferenceContext, StageCacheSpec
from megatron.core.inference.kernels import BACKEND_ENV, batch_invariant
from megatron.core.ssm.mamba_mixer import MambaMixer
from tests.unit_tests.dist_harness import device
from tests.unit_tests.ssm.test_mamba_mixer import HIDDEN, mamba_config
from tests.unit_tests.transformer.single_rank import on_single_rank

PROMPTS = {"a": 12, "b": 6, "c": 4}
# Steps as (request, new tokens): prefill chunks next to one-token (decode) rows, and a step of
# decode rows only; WHOLE runs each request in one piece.
PIECES = [[("b", 2), ("a", 5)], [("a", 4), ("c", 3)], [("a", 1), ("b", 4)], [("c", 1), ("a", 1), ("b", 0)], [("a", 1)]]
WHOLE = [[("a", 12)], [("b", 6), ("c", 4)]]
PAD_TO = 12


def mixer_and_inputs(pg):
    torch.manual_seed(0)
    config = mamba_config(mamba_num_heads=4)  # few heads: the interpreter runs a program per head
    mixer = MambaMixer(config, layer_number=1, pg_collection=pg, ssm_backend="torch").to(device())
    with torch.no_grad():
        for p in mixer.parameters():  # every parameter non-trivial (dt, A, D, conv bias)
            p.add_(torch.randn_like(p) * 0.2)
    gen = torch.Generator().manual_seed(1)
    hidden = {rid: torch.randn(n, HIDDEN, generator=gen).to(device()) for rid, n in PROMPTS.items()}
    return mixer, hidden


def context(config):
    """A context with one Mamba layer whose free slots hold NaN; the requests get scattered slots."""
    spec = StageCacheSpec.from_config(config, (), (1,), block_size=4, tp_size=1)
    ctx = DynamicInferenceContext(
        spec,
        Capacity(num_blocks=32, max_requests=5, num_mamba_slots=6),
        max_sequence_length=32,
        max_tokens_per_step=PAD_TO,
        is_hybrid_model=True,
        device=device(),
    )
    ctx.mamba_slots.conv.fill_(float("nan"))
    ctx.mamba_slots.ssm.fill_(float("nan"))
    ctx.add_request("spacer", [0])
    for rid, n in PROMPTS.items():
        ctx.add_request(rid, [0] * n)
    spacer = ctx.request("spacer").mamba_slot
    ctx.release_request("spacer")
    ctx.mamba_slots.conv[:, spacer] = ctx.mamba_slots.ssm[:, spacer] = float("nan")
    return ctx


def run_steps(mixer, hidden, steps, backend, monkeypatch, invariant=True, request_rows=None):
    """Run ``steps`` through the mixer on a fresh context; per request its output rows, and the context.
    ``request_rows``: pad each step's request rows to this many with requests of no token (as a
    mixed CUDA-graph step does)."""
    monkeypatch.setenv(BACKEND_ENV, backend)
    ctx = context(mixer.config)
    done = dict.fromkeys(PROMPTS, 0)
    outputs = {rid: [] for rid in PROMPTS}
    pad = torch.randn(PAD_TO, HIDDEN, generator=torch.Generator().manual_seed(2)).to(device())
    for schedule in steps:
        schedule = [(rid, n) for rid, n in schedule if n]
        batch = ctx.build_step(schedule, pad_to_tokens=PAD_TO, pad_to_requests=request_rows, padding_request_tokens=0)
        rows = [hidden[rid][done[rid] : done[rid] + n] for rid, n in schedule]
        x = torch.cat([*rows, pad[: PAD_TO - batch.num_tokens]])[:, None]
        with torch.no_grad(), batch_invariant(invariant):
            out, _ = mixer(x, inference_context=ctx)
        ctx.commit_step()
        start = 0
        for rid, n in schedule:
            outputs[rid].append(out[start : start + n, 0])
            done[rid] += n
            start += n
    return {rid: torch.cat(o) for rid, o in outputs.items() if o}, ctx


def slot_states(ctx):
    slots = [ctx.request(rid).mamba_slot for rid in PROMPTS]
    return ctx.mamba_slots.conv[0, slots], ctx.mamba_slots.ssm[0, slots], slots


def assert_close_to(got, want, rel):
    scale = want.abs().max().item()
    assert scale > 0.05 and (got - want).abs().max().item() <= rel * scale


@on_single_rank
def test_triton_recurrence_matches_token_by_token_path_is_split_invariant_and_leaves_other_slots(pg, monkeypatch):
    mixer, hidden = mixer_and_inputs(pg)
    want, want_ctx = run_steps(mixer, hidden, PIECES, "torch", monkeypatch)
    got, got_ctx = run_steps(mixer, hidden, PIECES, "triton", monkeypatch)
    whole, whole_ctx = run_steps(mixer, hidden, WHOLE, "triton", monkeypatch)
    for rid in PROMPTS:
        assert torch.isfinite(got[rid]).all()
        assert_close_to(got[rid], want[rid], 1e-5)
        assert torch.equal(got[rid], whole[rid]), rid
    (conv, ssm, slots), (want_conv, want_ssm, _) = slot_states(got_ctx), slot_states(want_ctx)
    assert_close_to(conv, want_conv, 1e-5)
    assert_close_to(ssm, want_ssm, 1e-5)
    assert torch.equal(conv, slot_states(whole_ctx)[0]) and torch.equal(ssm, slot_states(whole_ctx)[1])
    unused = [s for s in range(6) if s not in slots]
    assert torch.isnan(got_ctx.mamba_slots.ssm[0, unused]).all()
    assert torch.isnan(got_ctx.mamba_slots.conv[0, unused]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@on_single_rank
def test_request_rows_of_no_token_change_no_output_and_no_state(pg, monkeypatch, backend):
    mixer, hidden = mixer_and_inputs(pg)
    want, want_ctx = run_steps(mixer, hidden, PIECES, backend, monkeypatch)
    got, got_ctx = run_steps(mixer, hidden, PIECES, backend, monkeypatch, request_rows=5)
    for rid in PROMPTS:
        assert torch.equal(got[rid], want[rid]), rid
    for state, expected in zip(slot_states(got_ctx)[:2], slot_states(want_ctx)[:2], strict=True):
        assert torch.equal(state, expected)


@on_single_rank
def test_chunked_prefill_matches_the_recurrence_and_carries_state_between_pieces(pg, monkeypatch):
    mixer, hidden = mixer_and_inputs(pg)
    backend = "torch" if device().type == "cpu" else "triton"
    rel = 1e-5 if device().type == "cpu" else 2e-3  # mamba-ssm's scan multiplies in TF32
    want, want_ctx = run_steps(mixer, hidden, PIECES, backend, monkeypatch, invariant=True)
    got, got_ctx = run_steps(mixer, hidden, PIECES, backend, monkeypatch, invariant=False)
    for rid in PROMPTS:
        assert_close_to(got[rid], want[rid], rel)
    assert not torch.equal(got["a"], want["a"])  # the scan really ran: it rounds differently
    for got_state, want_state in zip(slot_states(got_ctx)[:2], slot_states(want_ctx)[:2], strict=True):
        assert_close_to(got_state, want_state, rel)


@pytest.mark.gpu(1)
def test_gpu_decode_and_prefill_kernels_at_hybrid_shapes_match_the_reference_and_split_invariance():
    """The hybrid 1.3B mixer's shapes (64 heads x 64, 8 groups, state 128) in bf16: the packed
    recurrence against ``ssd_step`` token by token, and a request's bits the same as one prefill
    of 40 tokens or 20 + 20 decode-and-prefill steps."""
    from megatron.core.ssm.inference_triton import packed_recurrence
    from megatron.core.ssm.mixer_reference import causal_conv1d_silu
    from megatron.core.ssm.ssd_reference import ssd_step

    torch.manual_seed(0)
    heads, head_dim, groups, state, width = 64, 64, 8, 128, 4
    channels = heads * head_dim + 2 * groups * state
    conv_w = (torch.randn(channels, 1, width, device="cuda") * 0.3).bfloat16()
    conv_b = (torch.randn(channels, device="cuda") * 0.1).bfloat16()
    A_log = torch.rand(heads, device="cuda") * 2 - 1
    D, dt_bias = torch.randn(heads, device="cuda").bfloat16(), (torch.randn(heads, device="cuda") - 3).bfloat16()
    tokens = 40
    xBC = torch.randn(tokens, channels, device="cuda").bfloat16()
    dt = torch.randn(tokens, heads, device="cuda").bfloat16()

    def run(pieces):
        conv_slots = torch.zeros(3, channels, width - 1, device="cuda")
        ssm_slots = torch.zeros(3, heads, head_dim, state, device="cuda")
        ys, start = [], 0
        for n in pieces:
            cu = torch.tensor([0, n], device="cuda")
            slot = torch.tensor([1], device="cuda")
            args = (conv_w, conv_b, A_log, D, dt_bias, conv_slots, ssm_slots, slot, cu, groups)
            ys.append(packed_recurrence(xBC[start : start + n], dt[start : start + n], *args))
            start += n
        return torch.cat(ys), conv_slots[1], ssm_slots[1]

    whole, conv_whole, ssm_whole = run([tokens])
    split, conv_split, ssm_split = run([1, 19, 1, 1, 18])
    assert torch.equal(whole, split) and torch.equal(conv_whole, conv_split) and torch.equal(ssm_whole, ssm_split)

    x_conv = causal_conv1d_silu(xBC.float()[None], conv_w.float(), conv_b.float())[0]
    x, B, C = x_conv.split([heads * head_dim, groups * state, groups * state], -1)
    ssm = torch.zeros(1, heads, head_dim, state, device="cuda")
    step_dt = torch.nn.functional.softplus(dt.float() + dt_bias.float())
    want = []
    for t in range(tokens):
        y, ssm = ssd_step(
            ssm,
            x[t].reshape(1, heads, head_dim),
            step_dt[t][None],
            -torch.exp(A_log),
            B[t].reshape(1, groups, state),
            C[t].reshape(1, groups, state),
            D.float(),
        )
        want.append(y.reshape(-1))
    want = torch.stack(want)
    assert (whole.float() - want).abs().max() <= 2e-2 * want.abs().max()
    assert (ssm_whole - ssm[0]).abs().max() <= 2e-2 * ssm.abs().max()


@pytest.mark.gpu(1)
def test_gpu_decode_replays_in_a_cuda_graph_and_matches_selective_state_update():
    """A decode bucket of 8 requests on scattered slots captured once and replayed for new
    tokens and new slot assignments: every replay gives the eager bits (outputs and slots), and
    the step agrees with mamba-ssm's ``selective_state_update`` (when it imports; else the torch
    ``ssd_step``) on the same states."""
    from megatron.core.ssm.backends import TorchSSMBackend, get_ssm_backend, load_mamba_kernels
    from megatron.core.ssm.inference_triton import packed_recurrence

    gen = torch.Generator(device="cuda").manual_seed(3)
    heads, head_dim, groups, state, width, requests, num_slots = 64, 64, 8, 128, 4, 8, 20
    channels = heads * head_dim + 2 * groups * state

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=gen) * scale

    params = (
        randn(channels, 1, width, scale=0.3).bfloat16(),
        randn(channels, scale=0.1).bfloat16(),
        torch.rand(heads, device="cuda", generator=gen) * 2 - 1,
        randn(heads).bfloat16(),
        (randn(heads) - 3).bfloat16(),
    )
    conv_slots = randn(num_slots, channels, width - 1)
    ssm_slots = randn(num_slots, heads, head_dim, state, scale=0.1)
    xBC = torch.zeros(requests, channels, dtype=torch.bfloat16, device="cuda")
    dt = torch.zeros(requests, heads, dtype=torch.bfloat16, device="cuda")
    slot_ids = torch.zeros(requests, dtype=torch.long, device="cuda")
    cu = torch.arange(requests + 1, device="cuda")

    def step(conv, ssm):
        return packed_recurrence(xBC, dt, *params, conv, ssm, slot_ids, cu, groups)

    def new_tokens():
        xBC.copy_(randn(requests, channels).bfloat16())
        dt.copy_(randn(requests, heads).bfloat16())
        slot_ids.copy_(torch.randperm(num_slots, device="cuda", generator=gen)[:requests])

    new_tokens()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(conv_slots.clone(), ssm_slots.clone())  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(conv_slots, ssm_slots)
    kernels = load_mamba_kernels()
    backend = get_ssm_backend(torch.device("cuda"), "triton") if kernels is not None else TorchSSMBackend()
    conv_weight, conv_bias, A_log, D, dt_bias = params
    for _ in range(3):
        new_tokens()
        conv_eager, ssm_eager = conv_slots.clone(), ssm_slots.clone()
        conv_before, ssm_reference = conv_slots[slot_ids], ssm_slots[slot_ids]  # copies
        graph.replay()
        eager = step(conv_eager, ssm_eager)
        assert torch.equal(captured, eager)
        assert torch.equal(conv_slots, conv_eager) and torch.equal(ssm_slots, ssm_eager)

        window = torch.cat([conv_before, xBC.float()[:, :, None]], -1)  # [R, c, d_conv]
        assert torch.equal(conv_slots[slot_ids], window[..., 1:])
        x_conv = torch.nn.functional.silu((window * conv_weight.float().squeeze(1)).sum(-1) + conv_bias.float())
        x, B, C = x_conv.bfloat16().split([heads * head_dim, groups * state, groups * state], -1)
        want = backend.state_update(
            ssm_reference,
            x.reshape(requests, heads, head_dim),
            dt,
            -torch.exp(A_log),
            B.reshape(requests, groups, state),
            C.reshape(requests, groups, state),
            D,
            dt_bias,
        ).flatten(1)
        assert (captured.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
        assert (ssm_slots[slot_ids] - ssm_reference).abs().max() <= 1e-2 * ssm_reference.abs().max()
