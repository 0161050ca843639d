"""Muon: SGD momentum whose update of each weight matrix is orthogonalized (Megatron's
``--optimizer muon``).

Per step, for a matrix ``W`` with gradient ``G`` (fp32 masters, learning rate ``lr``, weight
decay ``wd``, momentum ``beta``)::

    W <- W - lr * wd * W                      (decoupled weight decay)
    M <- beta * M + (1 - beta) * G            (EMA momentum, ``momentum_buffer``)
    D <- M, or with Nesterov G + beta * (M - G)
    W <- W - lr * s * NS(D)

``NS`` runs Newton-Schulz iterations ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` (on the
smaller side of ``X``, which starts as ``D / ||D||_F``) with the published coefficient sets;
it maps ``D = U S V^T`` to about ``U V^T``. ``s`` is the scale of ``muon_scale_mode`` for the
matrix's full shape, times ``muon_extra_scale_factor``.

What a "matrix" is follows Megatron: the fused QKV weight is orthogonalized as three matrices
(Q, K and V, each over all heads) unless ``muon_split_qkv`` is off; each expert of a grouped
expert weight ``[experts, in, out]`` is its own matrix. A tensor-parallel shard is gathered over
its group so the whole matrix is orthogonalized (``muon_tp_mode`` ``duplicated``, and
``distributed``, which computes the same thing here) and the rank keeps its slice: the update is
the same under every TP size. ``blockwise`` orthogonalizes each shard alone (it depends on TP).
With the distributed optimizer a rank holds flat pieces of the matrices: the pieces of the
directions are summed over the replica group into whole matrices first (they are disjoint).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.collectives import all_gather_along_dim, all_reduce_coalesced

# Newton-Schulz coefficient sets (a, b, c) per iteration, by Megatron's --muon-coefficient-type:
# "simple" repeats one set; "quintic" and "aol" cycle theirs (steps: a multiple of their length);
# "polar_express" runs its 8 sets and then repeats the last.
NS_COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}


def ns_coefficients(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` Newton-Schulz iterations; ValueError names the rule
    a step count breaks."""
    sets = NS_COEFFICIENTS[kind]
    if steps < 1:
        raise ValueError(f"muon_num_ns_steps must be >= 1, got {steps}")
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        if steps < len(sets):
            raise ValueError(f"muon_num_ns_steps ({steps}) must be >= {len(sets)} for polar_express")
        return sets + [sets[-1]] * (steps - len(sets))
    if steps % len(sets):
        raise ValueError(f"muon_num_ns_steps ({steps}) must be a multiple of {len(sets)} for {kind}")
    return sets * (steps // len(sets))


def newton_schulz(x: torch.Tensor, coefficients, low_precision: bool) -> torch.Tensor:
    """About ``U V^T`` of each matrix ``x [..., m, n] = U S V^T`` (fp32 in and out); with
    ``low_precision`` the iterations multiply in bf16."""
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-7)
    if low_precision:
        X = X.bfloat16()
    for a, b, c in coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    X = X.float()
    return X.mT if transpose else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """Megatron's Muon update scales of a ``rows x cols`` matrix."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    return max(1.0, rows / cols) ** 0.5  # shape_scaling


@dataclass
class MuonMatrix:
    """A weight Muon steps: ``param`` (this rank's TP shard), the TP-local row counts of the parts
    orthogonalized apart (``split_rows``, None: one matrix) and the group whose shards along
    ``partition_dim`` make up the whole matrix (None: the shard is the matrix)."""

    param: torch.nn.Parameter
    split_rows: list[int] | None = None
    tp_group: dist.ProcessGroup | None = None
    partition_dim: int | None = None


class Muon(torch.optim.Optimizer):
    """Muon over fp32 masters (see the module docstring).

    ``places`` gives, per master, ``(matrix, start, end)``: the :class:`MuonMatrix` it belongs
    to and its flat element range of it (``start`` None: the whole matrix). ``replica_groups``
    (distributed optimizer) lists ``(group, matrices)``: the replicas that hold the other
    pieces of those matrices, every member listing the same matrices in the same order.
    """

    def __init__(self, params, places: dict, replica_groups: list, config):
        defaults = dict(lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum)
        super().__init__(params, defaults)
        self.places = places
        # the order every rank orthogonalizes in (the TP gathers must pair up across the group)
        listed = [m for _, matrices in replica_groups for m in matrices] or [m for m, _, _ in places.values()]
        self.order = list({id(m.param): m for m in listed}.values())
        self.replica_groups = replica_groups
        self.nesterov = config.muon_nesterov
        self.coefficients = ns_coefficients(config.muon_coefficient_type, config.muon_num_ns_steps)
        self.low_precision = config.muon_fp32_matmul_prec != "high"
        self.blockwise = config.muon_tp_mode == "blockwise"
        self.scale_mode = config.muon_scale_mode
        self.extra_scale = config.muon_extra_scale_factor

    @torch.no_grad()
    def step(self, closure=None):
        directions: dict[int, torch.Tensor] = {}  # id(param) -> whole-matrix direction
        stepped = []
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            for master in group["params"]:
                if master.grad is None:
                    continue
                grad, state = master.grad, self.state[master]
                momentum = state.setdefault("momentum_buffer", torch.zeros_like(master))
                state["step"] = state.get("step", 0) + 1
                if group["weight_decay"] > 0:
                    master.add_(master, alpha=-lr * group["weight_decay"])
                momentum.lerp_(grad, 1 - beta)
                direction = grad.lerp(momentum, beta) if self.nesterov else momentum
                matrix, start, end = self.places[id(master)]
                if start is None:
                    directions[id(matrix.param)] = direction
                else:
                    whole = directions.setdefault(id(matrix.param), master.new_zeros(matrix.param.shape))
                    whole.view(-1)[start:end] = direction
                stepped.append((master, lr))
        self._complete_pieces(directions)
        updates = {
            id(m.param): self._orthogonalize(m, directions[id(m.param)])
            for m in self.order
            if id(m.param) in directions
        }
        for master, lr in stepped:
            matrix, start, end = self.places[id(master)]
            update = updates[id(matrix.param)]
            master.add_(update if start is None else update.view(-1)[start:end], alpha=-lr)

    def _complete_pieces(self, directions: dict[int, torch.Tensor]) -> None:
        """Sum the disjoint pieces of every matrix over its replicas (distributed optimizer)."""
        for group, matrices in self.replica_groups:
            if dist.get_world_size(group) == 1:
                continue
            for m in matrices:  # a matrix with no piece here adds zeros
                if id(m.param) not in directions:
                    directions[id(m.param)] = torch.zeros(m.param.shape, device=m.param.device)
            all_reduce_coalesced([directions[id(m.param)] for m in matrices], group)

    def _orthogonalize(self, matrix: MuonMatrix, direction: torch.Tensor) -> torch.Tensor:
        parts = [direction] if matrix.split_rows is None else direction.split(matrix.split_rows, dim=-2)
        return torch.cat([self._orthogonalize_part(matrix, part) for part in parts], dim=-2)

    def _orthogonalize_part(self, matrix: MuonMatrix, part: torch.Tensor) -> torch.Tensor:
        gather = matrix.tp_group is not None and not self.blockwise and dist.get_world_size(matrix.tp_group) > 1
        whole = all_gather_along_dim(part.contiguous(), matrix.partition_dim, matrix.tp_group) if gather else part
        update = newton_schulz(whole, self.coefficients, self.low_precision)
        update = update * (scale_factor(whole.size(-2), whole.size(-1), self.scale_mode) * self.extra_scale)
        if gather:
            update = update.chunk(dist.get_world_size(matrix.tp_group), dim=matrix.partition_dim)
            update = update[dist.get_rank(matrix.tp_group)]
        return update
