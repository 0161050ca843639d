"""Mixed-precision optimizer: fp32 master weights, loss scaling, skipped steps, global clipping.

:class:`MegatronOptimizer` wraps a torch optimizer (AdamW or SGD) that steps fp32 *master*
tensors. For an fp32 model parameter the master is the parameter itself (a view, no copy);
for bf16/fp16 parameters it is an fp32 copy, written back to the parameter after each step.
Gradients come from ``param.main_grad`` (DDP buffers) or ``param.grad``.

One step (:func:`step_optimizers`, shared with the chained and MIMO optimizers, which differ only in
how ranks agree on its decisions): with a loss scaler, unscale the gradients, agree on inf/nan over
the whole job (MAX over ``mp`` then ``dp_cp``), update the scaler and skip the step if anything
overflowed; then compute the true global gradient norm (see :mod:`clip_grads`), skip the step if it
is not finite (how bf16/fp32 runs, which have nothing to unscale, find inf/nan without a pass over
the gradients of their own), clip, step and copy back. With torch's fused AdamW (CUDA) the clipping
factor rides in the step's ``grad_scale`` instead of a pass of its own; without a loss scaler the
skip decision rides in its ``found_inf`` too, so the whole step is launched before the host reads
the norm (no device idle while the host decides).

The torch optimizer's state is indexed by position in :attr:`MegatronOptimizer.master_params`,
whose entries name the model parameter (and flat element range) each master stands for.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.core.fusions.backend import fused_backend
from megatron.core.optimizer.clip_grads import (
    clip_coefficient,
    clip_grads_by_total_norm,
    count_zeros_fp32,
    grad_counted_on_this_rank,
    grad_norm_fp32,
    root_sum_squares,
    stats_device,
    unscale_and_find_nonfinite,
)
from megatron.core.optimizer.flat_adamw import MAX_LAUNCHES, FlatAdamW, flat_launch_count
from megatron.core.optimizer.muon import Muon
from megatron.core.optimizer.optimizer_config import OptimizerConfig


@dataclass
class MasterParam:
    """An fp32 tensor the torch optimizer steps and the model parameter it stands for:
    the whole parameter (``start`` None) or the flat elements ``[start, end)`` of it."""

    model_param: torch.nn.Parameter
    master: torch.Tensor
    start: int | None
    end: int | None
    counted: bool  # enters global grad statistics on this rank

    def model_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a parameter-shaped ``tensor`` this master covers."""
        return tensor if self.start is None else tensor.reshape(-1)[self.start : self.end]

    @property
    def is_copy(self) -> bool:
        return self.master.dtype != self.model_param.dtype


def _model_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _build_torch_optimizer(
    config: OptimizerConfig, groups: list[dict], entries: list[MasterParam], muon: tuple | None = None
) -> torch.optim.Optimizer:
    """AdamW, SGD or Muon over the masters. AdamW is :class:`FlatAdamW` (one kernel per flat buffer,
    writing the parameters' copies too) where the fused ``adamw`` op runs on Triton and the
    masters' gradients and parameters lie in DDP's flat buffers; else torch's fused (one-kernel)
    implementation when every master is on CUDA; torch's default (bit-stable reference)
    implementation on CPU. Muon takes ``muon``: ``({id(param): MuonMatrix}, replica groups)``."""
    if config.optimizer == "muon":
        matrices, replica_groups = muon
        places = {id(e.master): (matrices[id(e.model_param)], e.start, e.end) for e in entries}
        return Muon(groups, places, replica_groups, config)
    if config.optimizer == "adam":
        masters = [tensor for group in groups for tensor in group["params"]]
        betas = (config.adam_beta1, config.adam_beta2)
        options = dict(lr=config.lr, betas=betas, eps=config.adam_eps, weight_decay=config.weight_decay)
        if masters and fused_backend("adamw", masters[0].device) == "triton":
            by_master = {id(entry.master): entry for entry in entries}
            sources = [_flat_sources(by_master[id(master)]) for master in masters]
            launches = flat_launch_count(sources, masters)
            if launches is not None and launches <= MAX_LAUNCHES:
                return FlatAdamW(groups, sources, **options)
        on_cuda = bool(masters) and all(tensor.is_cuda for tensor in masters)
        return torch.optim.AdamW(groups, **options, fused=True if on_cuda else None)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, weight_decay=config.weight_decay)


def _flat_sources(entry: MasterParam) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gradient view (DDP's ``main_grad``, None without one) and the model-parameter view
    ``entry``'s master is stepped from and written to."""
    main_grad = getattr(entry.model_param, "main_grad", None)
    grad = None if main_grad is None else entry.model_view(main_grad)
    return grad, entry.model_view(entry.model_param.detach())


class MegatronOptimizer:
    """Mixed-precision optimizer over model parameters.

    Args:
        config: the :class:`OptimizerConfig`.
        param_groups: dicts with ``params`` (model parameters), ``wd_mult`` and ``lr_mult``;
            each becomes a torch param group with ``lr = config.lr * lr_mult`` and
            ``weight_decay = config.weight_decay * wd_mult`` (what the LR scheduler keeps up).
        pg_collection: groups of this rank (``tp``, ``gtp``, ``pp`` ranks; ``mp``, ``dp_cp``).
        grad_scaler: a loss scaler or None (scale 1); chained members may share one.
        matrices: with ``config.optimizer == "muon"``, the :class:`MuonMatrix` of every
            parameter by ``id``.
    """

    def __init__(
        self, config: OptimizerConfig, param_groups: list[dict], pg_collection, grad_scaler=None, matrices=None
    ):
        self.config = config
        self.pg_collection = pg_collection
        self.grad_scaler = grad_scaler
        self.device = stats_device(pg_collection.mp)
        self.master_params: list[MasterParam] = []
        torch_groups = []
        for group in param_groups:
            entries = [entry for param in group["params"] for entry in self._master_entries(param)]
            self.master_params.extend(entries)
            torch_groups.append(
                {
                    "params": [entry.master for entry in entries],
                    "lr_mult": group["lr_mult"],
                    "wd_mult": group["wd_mult"],
                    "is_decoupled_lr": group.get("is_decoupled_lr", False),
                    "lr": config.lr * group["lr_mult"],
                    "weight_decay": config.weight_decay * group["wd_mult"],
                }
            )
        muon = None if matrices is None else (matrices, self._replica_groups(matrices))
        self.optimizer = _build_torch_optimizer(config, torch_groups, self.master_params, muon)

    def _master_entries(self, param: torch.nn.Parameter) -> list[MasterParam]:
        """Masters standing for ``param`` on this rank (the whole parameter here)."""
        return [self._make_master(param, None, None)]

    def _replica_groups(self, matrices: dict) -> list:
        """Muon's ``(group, matrices)`` whose members hold the other pieces of those matrices:
        none, a rank steps whole parameters here."""
        return []

    def _make_master(self, param, start, end) -> MasterParam:
        """fp32 params are stepped in place (the master is a view); others get an fp32 copy."""
        view = param.detach() if start is None else param.detach().reshape(-1)[start:end]
        master = view if param.dtype == torch.float32 else view.float().clone()
        return MasterParam(param, master, start, end, grad_counted_on_this_rank(param, self.pg_collection))

    # Groups whose members hold disjoint gradient pieces (summed for norms and zero counts).
    def _sum_groups(self, expert: bool = False) -> list:
        return [self.pg_collection.expert_mp_group() if expert else self.pg_collection.mp]

    def _domains(self, tensor_of: Callable[[MasterParam], torch.Tensor | None]) -> list[tuple[list, list]]:
        """``(tensors, sum groups)`` per domain: ``tensor_of(entry)`` (its gradient, or the master
        itself) of every counted entry that has one; dense and expert entries are summed over
        their own groups, as one domain when those groups are the same."""
        dense_groups, expert_groups = self._sum_groups(), self._sum_groups(expert=True)
        counted = [e for e in self.master_params if e.counted and tensor_of(e) is not None]
        if all(a is b for a, b in zip(dense_groups, expert_groups, strict=True)):
            return [([tensor_of(e) for e in counted], dense_groups)]
        expert = [getattr(e.model_param, "is_expert", False) for e in counted]
        return [
            ([tensor_of(e) for e, is_expert in zip(counted, expert, strict=True) if not is_expert], dense_groups),
            ([tensor_of(e) for e, is_expert in zip(counted, expert, strict=True) if is_expert], expert_groups),
        ]

    def _grad_domains(self) -> list[tuple[list[torch.Tensor], list]]:
        return self._domains(lambda entry: entry.master.grad)

    def _job_groups(self) -> list:
        """Groups whose union is the whole job (for the inf/nan decision)."""
        return [self.pg_collection.mp, self.pg_collection.dp_cp]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate (multiplied by the current loss scale)."""
        return loss * self.get_loss_scale()

    def _master_grads(self) -> list[torch.Tensor]:
        return [entry.master.grad for entry in self.master_params if entry.master.grad is not None]

    def prepare_grads(self) -> bool:
        """Give each master its (unscaled, fp32) gradient; return whether any rank of the job
        found inf/nan. Gradients that are fp32 views of ``main_grad`` are unscaled in place."""
        for entry in self.master_params:
            grad = _model_grad(entry.model_param)
            if grad is None:
                entry.master.grad = None
                continue
            grad = entry.model_view(grad)
            entry.master.grad = grad if grad.dtype == torch.float32 else grad.float()
        if self.grad_scaler is None:
            return False  # nothing to unscale: a non-finite gradient shows in the global norm
        return unscale_and_find_nonfinite(
            self._master_grads(), self.grad_scaler.inv_scale, self._job_groups(), self.device
        )

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the prepared gradients, each parameter counted once, as a
        one-element float64 tensor on the stats device (no host sync): the root of the
        gradient domains' squared fp32 norms."""
        return root_sum_squares([grad_norm_fp32(*domain, self.device).double() for domain in self._grad_domains()])

    def get_grad_norm(self) -> float:
        """:meth:`grad_norm` on the host."""
        return self.grad_norm().item()

    def params_norm(self) -> float:
        """Global L2 norm of the fp32 master parameters, each element counted once as in the
        gradient norm (Megatron's ``params norm``); every rank of the job must call it."""
        domains = self._domains(lambda entry: entry.master)
        return root_sum_squares([grad_norm_fp32(*domain, self.device).double() for domain in domains]).item()

    def count_zeros(self) -> int:
        return sum(count_zeros_fp32(grads, groups, self.device) for grads, groups in self._grad_domains())

    def clip_grad_norm(self, total_norm: float) -> None:
        if not self.steps_fused():
            clip_grads_by_total_norm(self._master_grads(), self.config.clip_grad, total_norm)
            return
        # Fused AdamW divides each gradient by ``grad_scale`` as it reads it: no pass of its own.
        coefficient = clip_coefficient(self.config.clip_grad, total_norm)
        if coefficient < 1.0:
            self.optimizer.grad_scale = torch.full((1,), 1.0 / coefficient, device=self.master_params[0].master.device)

    def steps_fused(self) -> bool:
        """Whether every group steps in torch's fused AdamW, which takes the clipping factor
        (``grad_scale``) and the skip decision (``found_inf``) as device tensors."""
        return all(group.get("fused") for group in self.optimizer.param_groups)

    def decide_on_device(self, total_norm: torch.Tensor) -> None:
        """Arm the next fused step with the clipping factor and the skip flag that the agreed
        global norm ``total_norm`` (a float64 device tensor) implies, computed on the device
        with the host path's float64 arithmetic: the step is skipped when the norm is not
        finite, and nothing waits for the norm's value."""
        device = self.master_params[0].master.device if self.master_params else total_norm.device
        self.optimizer.found_inf = (~torch.isfinite(total_norm)).to(device, torch.float32).reshape(())
        if self.config.clip_grad > 0:
            coefficient = clip_coefficient(self.config.clip_grad, total_norm)
            self.optimizer.grad_scale = torch.where(coefficient < 1.0, 1.0 / coefficient, 1.0).to(device, torch.float32)

    @torch.no_grad()
    def step_with_ready_grads(self) -> None:
        """Step the masters and write them back into the model parameters."""
        self.optimizer.step()
        self.optimizer.grad_scale = self.optimizer.found_inf = None  # the decisions of one step
        copies = [entry for entry in self.master_params if entry.is_copy]
        if copies and not isinstance(self.optimizer, FlatAdamW):  # which writes them as it steps
            torch._foreach_copy_([e.model_view(e.model_param.data) for e in copies], [e.master for e in copies])
        self._gather_params()

    def _gather_params(self) -> None:
        """Hook for optimizers that only updated part of each parameter."""

    def step(self) -> tuple[bool, float | None, int | None]:
        """One optimizer step; returns ``(update_successful, grad_norm, num_zeros_in_grad)``.
        On inf/nan the step is skipped everywhere and ``(False, None, None)`` is returned."""
        return step_optimizers([self])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop ``.grad`` of the model params and masters (DDP's ``main_grad`` is zeroed by
        ``DistributedDataParallel.zero_grad_buffer``). ``set_to_none`` is accepted for torch
        compatibility; gradients are always dropped, never zero-filled."""
        for entry in self.master_params:
            entry.master.grad = None
            entry.model_param.grad = None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 masters from the model parameters (after loading model weights)."""
        for entry in self.master_params:
            if entry.is_copy:
                entry.master.copy_(entry.model_view(entry.model_param.detach()))

    def state_numel(self) -> dict[str, int]:
        """Elements this rank holds per kind of state: separate fp32 masters and each
        optimizer state tensor (e.g. ``exp_avg``, ``exp_avg_sq``)."""
        sizes = {"master_params": sum(e.master.numel() for e in self.master_params if e.is_copy)}
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    sizes[key] = sizes.get(key, 0) + value.numel()
        return sizes

    def state_dict(self) -> dict:
        """Torch optimizer state (indexed like :attr:`master_params`), loss-scaler state and
        the fp32 master copies (None for masters that are the fp32 parameter itself)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "master_params": [e.master if e.is_copy else None for e in self.master_params],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and state_dict["grad_scaler"] is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        for entry, saved in zip(self.master_params, state_dict["master_params"], strict=True):
            if saved is not None:
                entry.master.copy_(saved)


def members_agree(values: list[float]) -> list[float]:
    """The default agreement of :func:`step_optimizers`: each member's value as this rank
    computed it, already job-wide because every member's own collectives span the job."""
    return values


def step_optimizers(
    optimizers: list, agree: Callable[[list[float]], list[float]] = members_agree
) -> tuple[bool, float | None, int | None]:
    """One agreed step over several optimizers: a single inf/nan decision, one loss-scaler
    update per distinct scaler, one global grad norm (root of the members' squared norms)
    used by every member to clip; returns ``(update_successful, grad_norm, num_zeros)``.

    ``agree`` takes one value per member (overflow flag, squared grad norm, zero count) and
    returns the values every rank of the job sums or tests, the same on all of them: the
    identity when the members' own groups span the job (:func:`members_agree`), a reduction
    over the job's group when ranks hold different members (the MIMO chain)."""
    if agree is members_agree and all(_decides_on_device(opt) for opt in optimizers):
        return _step_deciding_on_device(optimizers)
    found_inf = agree([float(opt.prepare_grads()) for opt in optimizers])  # every member joins its collectives
    skipped = any(flag > 0 for flag in found_inf)
    scalers = {id(opt.grad_scaler): opt.grad_scaler for opt in optimizers if opt.grad_scaler is not None}
    for scaler in scalers.values():
        scaler.update(skipped)
    if skipped:
        return False, None, None
    grad_norm = math.sqrt(sum(agree([opt.get_grad_norm() ** 2 for opt in optimizers])))
    if not math.isfinite(grad_norm):  # the norm is agreed: every rank skips together
        return False, None, None
    for opt in optimizers:
        if opt.config.clip_grad > 0:
            opt.clip_grad_norm(grad_norm)
    num_zeros = None
    if any(opt.config.log_num_zeros_in_grad for opt in optimizers):
        num_zeros = int(sum(agree([float(opt.count_zeros()) for opt in optimizers])))
    for opt in optimizers:
        opt.step_with_ready_grads()
    return True, grad_norm, num_zeros


def _decides_on_device(opt) -> bool:
    """Whether ``opt``'s step needs no host decision before it launches: no loss scaler (no
    overflow vote), no zero count, fused AdamW (clipping and skipping ride in its tensors)."""
    return opt.grad_scaler is None and not opt.config.log_num_zeros_in_grad and opt.steps_fused()


def _step_deciding_on_device(optimizers: list) -> tuple[bool, float | None, int | None]:
    """:func:`step_optimizers` without a host sync before the update: the global norm, the
    clipping factor and the skip flag stay on the device, the fused steps and the write-back
    are launched, and the norm is read once at the end. Same bits as the host path; a skipped
    step leaves masters, parameters and step counts as they were."""
    for opt in optimizers:
        opt.prepare_grads()  # no scaler: nothing to unscale, no vote
    total_norm = root_sum_squares([opt.grad_norm() for opt in optimizers])
    for opt in optimizers:
        opt.decide_on_device(total_norm)
        opt.step_with_ready_grads()
    grad_norm = total_norm.item()
    if not math.isfinite(grad_norm):
        return False, None, None
    return True, grad_norm, None
