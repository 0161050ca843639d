"""Mamba-2 mixer, tensor-parallel over heads and groups.

``in_proj`` packs ``[z, x, B, C, dt]`` (each part split over TP on its own), a depthwise causal
conv runs over the TP-local ``x|B|C`` channels, the SSD scan mixes along the sequence, a gated
RMSNorm normalizes per group, and ``out_proj`` (row parallel) reduces over TP. What runs between
the two projections is picked by the backend switch (:mod:`backends`): the torch reference, or
on CUDA one fused Triton path for training (:mod:`mixer_triton`). GTP sharding of the two
projections comes from the parallel linears; ``A_log``, ``D``, ``dt_bias``, the conv and the
norm weight are whole on every GTP peer (``gtp_sharded = False``). Under context parallelism
the sequence path runs on whole sequences of ``1/cp`` of the heads (:mod:`mamba_heads`).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.inference.kernels.mode import is_batch_invariant, kernel_backend
from megatron.core.parallel_state import resolve_pg_collection
from megatron.core.ssm.backends import MixerWeights, get_ssm_backend
from megatron.core.ssm.mixer_reference import causal_conv1d_silu, gated_rms_norm, rowwise
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.sharding import create_parallel_parameter
from megatron.core.transformer.context_parallel import ContextParallelConfigError, cp_size_of
from megatron.core.transformer.context_parallel.mamba_heads import MambaContextParallel
from megatron.core.transformer.init_methods import init_method, output_layer_init_method

# Initialization of the time step (Mamba-2's defaults): dt ~ log-uniform in [DT_MIN, DT_MAX],
# floored at DT_INIT_FLOOR, stored as its softplus inverse in dt_bias. A ~ uniform in A_INIT_RANGE.
DT_MIN, DT_MAX, DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4
A_INIT_RANGE = (1.0, 16.0)


class MambaInferenceContext(Protocol):
    """What the mixer needs from an inference context (the dynamic context adapts to this).

    ``mamba_states(layer_number)`` returns this layer's per-request state tensors, updated in
    place: ``conv_state [b, conv_channels, d_conv - 1]`` (the last inputs of the conv) and
    ``ssm_state [b, nheads, head_dim, d_state]`` (fp32), TP-local shapes as given by
    :meth:`MambaDims.conv_state_shape` / :meth:`MambaDims.ssm_state_shape`. Zero states mean a
    fresh request. ``is_decode_only()`` says the batch is one new token per request; otherwise it
    is a prefill of ``[s, b]`` tokens that continues from the given states.

    A context with a ``step`` attribute (the dynamic context's packed batch) instead packs R
    requests as ``[T, 1]`` tokens, request ``r``'s at ``step.cu_query_lengths[r]:[r + 1]``
    (``step.query_lengths`` each, ``step.host_query_lengths`` on the host; ``step.num_tokens``
    real tokens, ``step.request_ids``; ``step.decode_only``: one token per request row, on the
    host; ``step.row_buckets``: the row counts a part of the step may be padded to, see
    :class:`~megatron.core.inference.contexts.dynamic_context.StepBatch`), and ``mamba_states``
    has one row per request. Such a context may also offer
    ``mamba_state_slots(layer_number) -> (conv_slots [S, ...], ssm_slots [S, ...], slot_ids [R])``:
    the layer's slot tensors themselves and the step's slot of each request (on the device), for
    the Triton kernels that update the slots in place (a layer uses one of the two hooks per step).
    """

    def is_decode_only(self) -> bool: ...

    def mamba_states(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class MambaDims:
    """Sizes of one Mamba-2 mixer, global and TP-local (the one place they are computed)."""

    hidden_size: int
    nheads: int
    head_dim: int
    ngroups: int
    d_state: int
    d_conv: int
    tp_size: int

    @classmethod
    def from_config(cls, config: TransformerConfig, tp_size: int) -> MambaDims:
        """Read the mamba_* fields and check they split over ``tp_size``; ConfigError names them."""
        nheads, ngroups = config.mamba_num_heads, config.mamba_num_groups
        checks = [
            (
                nheads % tp_size == 0,
                f"mamba_num_heads ({nheads}) must be divisible by tensor_model_parallel_size ({tp_size})",
            ),
            (
                ngroups % tp_size == 0,
                f"mamba_num_groups ({ngroups}) must be divisible by tensor_model_parallel_size ({tp_size})",
            ),
            (nheads % ngroups == 0, f"mamba_num_heads ({nheads}) must be divisible by mamba_num_groups ({ngroups})"),
            (config.mamba_d_conv >= 2, f"mamba_d_conv must be >= 2, got {config.mamba_d_conv}"),
        ]
        errors = [message for ok, message in checks if not ok]
        if errors:
            raise ConfigError("; ".join(errors))
        return cls(
            config.hidden_size,
            nheads,
            config.mamba_head_dim,
            ngroups,
            config.mamba_state_dim,
            config.mamba_d_conv,
            tp_size,
        )

    @property
    def d_inner(self) -> int:
        return self.nheads * self.head_dim

    @property
    def in_proj_sizes(self) -> list[int]:
        """Global sizes of the packed in_proj parts ``[z, x, B, C, dt]``."""
        bc = self.ngroups * self.d_state
        return [self.d_inner, self.d_inner, bc, bc, self.nheads]

    @property
    def conv_sizes(self) -> list[int]:
        """Global sizes of the conv channel parts ``[x, B, C]``."""
        return self.in_proj_sizes[1:4]

    @property
    def norm_group_size(self) -> int:
        """Channels per gated-norm group (the heads of one B/C group share a statistic)."""
        return self.d_inner // self.ngroups

    def scan_flops_per_token(self, chunk_size: int) -> int:
        """Matmul FLOPs of the chunked SSD scan per token, forward + backward (3x forward), whole
        layer (all TP ranks). Forward, per token: within its chunk of ``Q`` tokens, ``C.B^T``
        (``2.Q.N`` per group) and its product with x (``2.Q.P`` per head), both halved by the causal
        mask as attention's are; the chunk state it feeds (``2.N.P`` per head) and the read-out of
        the carried state (``2.N.P`` per head)."""
        within_chunk = chunk_size * (self.d_state * self.ngroups + self.head_dim * self.nheads)
        return 3 * (within_chunk + 4 * self.d_state * self.head_dim * self.nheads)

    def local(self, size: int) -> int:
        return size // self.tp_size

    def split_in_proj(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(z, xBC, dt)`` of a TP-local in_proj output ``[..., z|x|B|C|dt]``."""
        sizes = [self.local(self.d_inner), self.local(sum(self.conv_sizes)), self.local(self.nheads)]
        return zxbcdt.split(sizes, dim=-1)

    def split_conv(self, xBC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of a TP-local conv output ``[..., x|B|C]``: x ``[..., h, p]``, B and C ``[..., g, n]``."""
        x, B, C = xBC.split([self.local(s) for s in self.conv_sizes], dim=-1)
        return (
            x.unflatten(-1, (-1, self.head_dim)),
            B.unflatten(-1, (-1, self.d_state)),
            C.unflatten(-1, (-1, self.d_state)),
        )

    def conv_state_shape(self) -> tuple[int, int]:
        """Per-request TP-local conv state: ``(conv_channels, d_conv - 1)``."""
        return (self.local(sum(self.conv_sizes)), self.d_conv - 1)

    def ssm_state_shape(self) -> tuple[int, int, int]:
        """Per-request TP-local SSM state: ``(nheads, head_dim, d_state)``."""
        return (self.local(self.nheads), self.head_dim, self.d_state)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x * silu(z))`` per group of ``group_size`` channels, times a weight.

    The statistic of each group is taken over its channels only (NemotronH / Mamba-2
    ``norm_before_gate=False``), so a TP rank holding whole groups needs no communication.
    """

    def __init__(self, weight: nn.Parameter, group_size: int, eps: float):
        super().__init__()
        self.weight = weight
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)


def _uniform_init(bound: float):
    return lambda t: nn.init.uniform_(t, -bound, bound)


def _init_A_log(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(torch.log(torch.empty_like(t).uniform_(*A_INIT_RANGE)))


def _init_dt_bias(t: torch.Tensor) -> None:
    with torch.no_grad():
        log_dt = torch.rand_like(t) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)
        dt = torch.exp(log_dt).clamp(min=DT_INIT_FLOOR)
        t.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus inverse


class MambaMixer(nn.Module):
    """Mamba-2 token mixer. ``forward(hidden [s, b, h], inference_context=None) -> (out [s, b, h], bias)``.

    ``ssm_backend``: ``"auto"`` (Triton on CUDA when mamba-ssm imports), ``"torch"`` or
    ``"triton"``; it may be changed on the module between calls.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, pg_collection=None, ssm_backend: str = "auto"):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.pg_collection = resolve_pg_collection(pg_collection)
        self.dims = dims = MambaDims.from_config(config, self.pg_collection.size("tp"))
        self.ssm_backend = ssm_backend
        pg = self.pg_collection
        self.context_parallel = MambaContextParallel(dims, pg.cp) if cp_size_of(pg) > 1 else None

        self.in_proj = ColumnParallelLinear(
            dims.hidden_size,
            sum(dims.in_proj_sizes),
            config=config,
            init_method=init_method(config),
            bias=config.add_bias_linear,
            output_partition_sizes=dims.in_proj_sizes,
            pg_collection=pg,
        )
        conv_channels = sum(dims.conv_sizes)
        conv_bound = 1.0 / math.sqrt(dims.d_conv)  # torch's Conv1d default (fan_in = d_conv)
        self.conv1d_weight = create_parallel_parameter(
            config,
            (conv_channels, 1, dims.d_conv),
            _uniform_init(conv_bound),
            pg,
            partition_dim=0,
            partition_sizes=dims.conv_sizes,
        )
        self.conv1d_bias = create_parallel_parameter(
            config,
            (conv_channels,),
            _uniform_init(conv_bound),
            pg,
            partition_dim=0,
            partition_sizes=dims.conv_sizes,
        )
        self.A_log = create_parallel_parameter(config, (dims.nheads,), _init_A_log, pg, partition_dim=0)
        self.dt_bias = create_parallel_parameter(config, (dims.nheads,), _init_dt_bias, pg, partition_dim=0)
        self.D = create_parallel_parameter(config, (dims.nheads,), nn.init.ones_, pg, partition_dim=0)
        norm_weight = create_parallel_parameter(config, (dims.d_inner,), nn.init.ones_, pg, partition_dim=0)
        self.norm = GatedRMSNorm(norm_weight, dims.norm_group_size, config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            dims.d_inner,
            dims.hidden_size,
            config=config,
            init_method=output_layer_init_method(config),
            bias=config.add_bias_linear,
            input_is_parallel=True,
            pg_collection=pg,
        )

    def forward(self, hidden_states: torch.Tensor, inference_context: MambaInferenceContext | None = None):
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, local z|x|B|C|dt]
        backend = get_ssm_backend(hidden_states.device, self.ssm_backend)
        cp, chunk_size, eps = self.context_parallel, self.config.mamba_chunk_size, self.norm.eps
        if inference_context is None and cp is not None:
            heads = cp.sequence_to_heads(zxbcdt)
            y = cp.heads_to_sequence(backend.mix(heads, cp.weights(self.weights()), cp.head_dims, chunk_size, eps))
        elif inference_context is None:
            y = backend.mix(zxbcdt, self.weights(), self.dims, chunk_size, eps)
        elif cp is not None:
            raise ContextParallelConfigError("Mamba inference runs at context_parallel_size=1")
        else:
            y = self._inference(backend, zxbcdt, inference_context)
        return self.out_proj(y)

    def weights(self) -> MixerWeights:
        """The parameters the backends' sequence path reads (TP-local)."""
        return MixerWeights(self.conv1d_weight, self.conv1d_bias, self.A_log, self.D, self.dt_bias, self.norm.weight)

    def _inference(self, backend, zxbcdt: torch.Tensor, inference_context: MambaInferenceContext) -> torch.Tensor:
        """Prefill or decode over the context's per-request states; returns the out_proj input ``[s, b, d]``."""
        z, xBC, dt = self.dims.split_in_proj(zxbcdt.transpose(0, 1))  # [b, s, ...]: the scan wants batch first
        if getattr(inference_context, "step", None) is not None:
            y = self._packed_step(backend, xBC[0], dt[0], inference_context).unsqueeze(0)
        else:
            conv_state, ssm_state = inference_context.mamba_states(self.layer_number)
            if inference_context.is_decode_only():
                y = self._step(backend, xBC, dt, conv_state, ssm_state)
            else:
                y = self._prefill(backend, xBC, dt, conv_state, ssm_state)
        if kernel_backend(y.device) == "triton":  # one program per row group: batch invariant
            from megatron.core.ssm.gated_norm_triton import gated_rms_norm_forward

            return gated_rms_norm_forward(y, z, self.norm.weight, self.dims.norm_group_size, self.norm.eps).transpose(
                0, 1
            )
        return self.norm(y, z).transpose(0, 1)

    def _prefill(self, backend, xBC, dt, conv_state, ssm_state):
        """Whole-sequence path continuing from (and advancing) the given conv and SSM states."""
        x, B, C = self.dims.split_conv(causal_conv1d_silu(xBC, self.conv1d_weight, self.conv1d_bias, conv_state))
        y, final_state = backend.chunk_scan(
            x, dt, self.weights().A, B, C, self.config.mamba_chunk_size, self.D, self.dt_bias, initial_state=ssm_state
        )
        ssm_state.copy_(final_state)
        return y.flatten(-2)

    def _packed_step(self, backend, xBC, dt, inference_context):
        """Inference over the packed step of a dynamic context: ``xBC [T, c]``, ``dt [T, h]``
        of R requests, request ``r``'s tokens at ``step.cu_query_lengths[r]:[r + 1]``, padding
        after the last (zero output); returns ``y [T, d_inner_local]``.

        In batch-invariant mode, and for decode-only steps in any mode, every token advances its
        request's state by the one-token recurrence, so a token's output and state are bitwise
        the same whether it came in a prefill chunk, a decode step or a recompute after
        eviction, and whatever else ran in the step: pausing, eviction and chunked prefill never
        change outputs. On the Triton backend the kernels of :mod:`inference_triton` run it over
        the whole step in place on the request slots; the torch path runs it token by token.
        Otherwise (batch-variant mode, a step with prefill) each prefilling request runs the
        chunked scan from its state (:meth:`_prefill`).
        """
        step = inference_context.step
        if not is_batch_invariant() and not step.decode_only:
            return self._packed_chunked_prefill(backend, xBC, dt, inference_context)
        if kernel_backend(xBC.device) == "triton" and hasattr(inference_context, "mamba_state_slots"):
            from megatron.core.ssm.inference_triton import packed_recurrence

            conv_slots, ssm_slots, slot_ids = inference_context.mamba_state_slots(self.layer_number)
            weights = self.weights()
            return packed_recurrence(
                xBC,
                dt,
                weights.conv_weight,
                weights.conv_bias,
                weights.A_log,
                weights.D,
                weights.dt_bias,
                conv_slots,
                ssm_slots,
                slot_ids,
                step.cu_query_lengths,
                self.dims.local(self.dims.ngroups),
            )
        if step.decode_only:
            return self._packed_decode(backend, xBC, dt, inference_context)
        return self._packed_token_by_token(backend, xBC, dt, inference_context)

    def _packed_decode(self, backend, xBC, dt, inference_context):
        """The one-token update of a decode-only packed step in torch: row ``r < R`` is request
        ``r``'s token, the rows past ``R`` padding tokens. All ``T`` rows run together (padding
        rows from zero states, their outputs zeroed and their states dropped), so the update has
        the step's padded shape, as in :meth:`_packed_token_by_token`; the states are gathered
        and written back by the step's slot ids on the device and nothing is read on the host:
        this is what a CUDA graph of a decode step replays."""
        conv_state, ssm_state = inference_context.mamba_states(self.layer_number)
        num_requests, num_rows = conv_state.shape[0], xBC.shape[0]
        conv = conv_state.new_zeros(num_rows, *conv_state.shape[1:])
        ssm = ssm_state.new_zeros(num_rows, *ssm_state.shape[1:])
        conv[:num_requests], ssm[:num_requests] = conv_state, ssm_state
        y = self._step(backend, xBC[:, None], dt[:, None], conv, ssm)[:, 0].to(xBC.dtype)
        conv_state.copy_(conv[:num_requests])
        ssm_state.copy_(ssm[:num_requests])
        y[num_requests:] = 0
        return y

    def _packed_token_by_token(self, backend, xBC, dt, inference_context):
        """The recurrence of :meth:`_packed_step` in torch, token by token. What does not carry
        state (each token's conv window from its request's inputs, conv and SiLU) runs for all
        ``T`` rows of the step at once, and the factors of the SSM updates for all of their
        calls at once: those ops are row invariant, so every row gets the bits the one-token
        step gives it. The SSM recurrence then advances the ``j``-th token of every request
        that has one, together, padded to the smallest of the step's ``row_buckets`` that holds
        them (sizes whose rows the engine checked bitwise against the largest), else to ``T``
        rows. The requests run longest first, so those with a ``j``-th token are a prefix of
        the working states; a request's state goes back to it once, its state after its last
        token (the rows past the prefix only pad later calls)."""
        conv_state, ssm_state = inference_context.mamba_states(self.layer_number)
        step = inference_context.step
        lengths = step.host_query_lengths
        starts = [0, *itertools.accumulate(lengths)]
        # (A request row of no token, as a mixed CUDA-graph step pads with, keeps its states.)
        order = sorted((row for row, length in enumerate(lengths) if length), key=lambda row: -lengths[row])
        buckets = step.row_buckets

        @functools.cache
        def padded_rows(count: int) -> int:
            return next((size for size in buckets if size >= count), xBC.shape[0])

        # Call j takes the j-th tokens of the first active[j] requests of ``order``, then padding
        # rows (token 0): its rows lie at calls[j] of the inputs gathered in call order, the
        # ones of real tokens at ``real``.
        active, calls, gathered, real = [], [], [], []
        count = len(order)
        for offset in range(lengths[order[0]] if order else 0):
            while lengths[order[count - 1]] <= offset:
                count -= 1
            num_rows = padded_rows(count)
            active.append(count)
            calls.append(slice(len(gathered), len(gathered) + num_rows))
            real += range(len(gathered), len(gathered) + count)
            gathered += [starts[row] + offset for row in order[:count]] + [0] * (num_rows - count)
        device = xBC.device
        windows = self._conv_windows(xBC, conv_state, lengths)
        x, B, C = self._conv_outputs(windows)
        index = torch.tensor(gathered, dtype=torch.long, device=device)
        rows = torch.tensor(order, dtype=torch.long, device=device)
        ssm = ssm_state.new_zeros(padded_rows(len(order)), *ssm_state.shape[1:])
        ssm[: len(order)] = ssm_state[rows]
        weights = self.weights()
        args = (x[index], dt[index], weights.A, B[index], C[index], self.D, self.dt_bias)
        out, final = backend.token_recurrence(*args, ssm, calls, active)
        ssm_state.index_copy_(0, rows, final.to(ssm_state.dtype))
        y = xBC.new_zeros(xBC.shape[0], self.dims.local(self.dims.d_inner))
        real = torch.tensor(real, dtype=torch.long, device=device)
        y.index_copy_(0, index[real], out.flatten(-2)[real].to(y.dtype))
        return y

    def _conv_windows(self, xBC, conv_state, lengths):
        """Each row's conv window ``[T, c, d_conv]`` over the packed step ``xBC [T, c]`` of
        requests of ``lengths`` tokens (the rows past them pad: they take row 0's window): its
        request's last ``d_conv - 1`` inputs before it (from ``conv_state [R, c, d_conv - 1]`` at
        first), then its own. Advances ``conv_state`` to each request's last inputs."""
        history = conv_state.shape[-1]
        device = xBC.device
        # Request r's inputs are its history (r * history on) then its tokens (past every history).
        inputs = torch.cat([conv_state.to(xBC.dtype).transpose(1, 2).reshape(-1, xBC.shape[1]), xBC])
        counts = torch.tensor(lengths, dtype=torch.long)
        request = torch.repeat_interleave(torch.arange(len(lengths)), counts)
        first = torch.cumsum(counts, 0) - counts
        offset = torch.arange(len(request)) - first[request]
        relative = offset[:, None] + torch.arange(history + 1) - history  # [tokens, d_conv]
        index = torch.where(
            relative < 0,
            request[:, None] * history + history + relative,
            conv_state.shape[0] * history + first[request][:, None] + relative,
        )
        index = torch.cat([index, index[:1].expand(xBC.shape[0] - len(request), -1)])
        windows = inputs[index.reshape(-1).to(device)].view(xBC.shape[0], history + 1, -1).transpose(1, 2)
        advanced = torch.nonzero(counts).flatten()  # a request with no token here keeps its state
        last = (first + counts - 1)[advanced]
        conv_state.index_copy_(0, advanced.to(device), windows[last.to(device), :, 1:].to(conv_state.dtype))
        return windows.contiguous()

    def _packed_chunked_prefill(self, backend, xBC, dt, inference_context):
        """Batch-variant step with prefill: each request of several new tokens runs the chunked
        scan from its conv and SSM state (:meth:`_prefill`: the conv state becomes the tail of
        its inputs, the SSM state the scan's final state), the decode tokens the one-token
        update together. Reads the step's lengths on the host."""
        conv_state, ssm_state = inference_context.mamba_states(self.layer_number)
        step = inference_context.step
        starts, lengths = step.cu_query_lengths[:-1].tolist(), step.query_lengths.tolist()
        y = xBC.new_zeros(xBC.shape[0], self.dims.local(self.dims.d_inner))
        decode_rows = []
        for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            if length == 1:
                decode_rows.append(row)
                continue
            tokens = slice(start, start + length)
            out = self._prefill(
                backend, xBC[None, tokens], dt[None, tokens], conv_state[row : row + 1], ssm_state[row : row + 1]
            )
            y[tokens] = out[0].to(y.dtype)
        if decode_rows:
            rows = torch.tensor(decode_rows, device=xBC.device)
            tokens = step.cu_query_lengths[rows]
            conv, ssm = conv_state[rows], ssm_state[rows]
            y[tokens] = self._step(backend, xBC[tokens, None], dt[tokens, None], conv, ssm)[:, 0].to(y.dtype)
            conv_state[rows], ssm_state[rows] = conv, ssm
        return y

    def _step(self, backend, xBC, dt, conv_state, ssm_state):
        """One-token decode path: advance the conv window and the SSM state in place."""
        if xBC.shape[1] != 1:
            raise ValueError(f"a decode step takes one token per request, got sequence length {xBC.shape[1]}")
        window = torch.cat([conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)  # [b, c, d_conv]
        conv_state.copy_(window[..., 1:])
        x, B, C = self._conv_outputs(window)
        y = backend.state_update(ssm_state, x, dt[:, 0], self.weights().A, B, C, self.D, self.dt_bias)
        return y.flatten(-2).unsqueeze(1)

    def _conv_outputs(self, window):
        """``x, B, C`` of tokens whose conv windows are ``window [b, c, d_conv]`` (contiguous):
        conv and SiLU, each row's bits independent of ``b``."""
        conv_out = (window * self.conv1d_weight.squeeze(1)).sum(-1) + self.conv1d_bias
        return self.dims.split_conv(rowwise(F.silu, conv_out))
