"""AdamW over flat buffers: one Triton kernel steps every master of a buffer (one launch for its
16-byte-aligned tiles, one for the rest) and writes the model parameters' low-precision copy in
the same pass.

Torch's fused AdamW walks hundreds of tensors and the mixed-precision optimizer then copies each
updated fp32 master into its bf16 parameter: about 40 bytes of memory traffic per element in two
passes. :class:`FlatAdamW` reads the gradient, master and both moments once and writes the
master, the moments and the parameter once (30 bytes), over tiles of the flat buffers that DDP
already keeps (``param.main_grad`` and the parameter data are views of them, see
:mod:`megatron.core.distributed.param_and_grad_buffer`). The update is ``torch.optim.AdamW``'s.

It is a ``torch.optim.Optimizer`` with torch AdamW's state keys (``step``, ``exp_avg``,
``exp_avg_sq``) and param groups (``lr``, ``betas``, ``eps``, ``weight_decay``, ``fused=True``):
as with torch's fused AdamW, ``grad_scale`` (divides the gradients) and ``found_inf`` (skips the
step, step counts included) are one-element device tensors set on it before :meth:`step`, so
the step needs no host decision. It owns the storage of its state: the moments, and the
masters that are copies of low-precision parameters, are views of one flat tensor per buffer;
state something else installs (``load_state_dict``, a checkpoint load) is copied into that
storage when it is loaded or, when written into ``state`` directly, at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core.errors import MegatronRuntimeError

# Masters whose gradients and parameters fall in more distinct storages than this are not worth
# a launch each (parameters outside DDP's buffers): torch's fused AdamW steps them instead.
MAX_LAUNCHES = 16
_MOMENTS = ("exp_avg", "exp_avg_sq")


class FlatAdamWError(MegatronRuntimeError):
    """A master's gradient is not the view of the flat gradient storage it was laid out with."""


@dataclass
class _Launch:
    """The flat bases one buffer's launches step, and their tile tables (see ``tile_tables``)."""

    grad: torch.Tensor
    param: torch.Tensor | None  # None: the masters are the (fp32) model parameters
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    tiles: dict[bool, torch.Tensor]


def _storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor of ``t``'s dtype over the whole of ``t``'s storage."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))


def _launch_key(grad: torch.Tensor, master: torch.Tensor, param: torch.Tensor) -> tuple[int, int, bool]:
    copy = master.dtype != param.dtype
    return grad.untyped_storage().data_ptr(), (param if copy else master).untyped_storage().data_ptr(), copy


def flat_launch_count(sources: list[tuple[torch.Tensor, torch.Tensor]], masters: list[torch.Tensor]) -> int | None:
    """How many launches :class:`FlatAdamW` needs for ``masters`` with these ``(gradient, model
    parameter)`` sources, or None where it cannot step them (a gradient or master that is not
    a contiguous fp32 tensor, or a master that is neither its parameter nor a copy of it)."""
    keys = set()
    for master, (grad, param) in zip(masters, sources, strict=True):
        if grad is None or grad.dtype != torch.float32 or master.dtype != torch.float32:
            return None
        if not (grad.is_contiguous() and master.is_contiguous() and param.is_contiguous()):
            return None
        if grad.numel() != master.numel() or param.numel() != master.numel() or grad.device != master.device:
            return None
        if param.dtype == master.dtype and master.data_ptr() != param.data_ptr():
            return None
        keys.add(_launch_key(grad, master, param))
    return len(keys)


class FlatAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) over fp32 masters, one Triton kernel over each flat buffer.

    Args:
        params: param groups of fp32 masters, as for ``torch.optim.AdamW``.
        sources: per master, in param-group order, its gradient (a view of a flat fp32 gradient
            storage: what ``master.grad`` will be at every step) and its model parameter (the
            master itself, or the low-precision parameter the master is a copy of).
        lr, betas, eps, weight_decay: the defaults of every group.
    """

    def __init__(self, params, sources, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        from megatron.core.fusions import adamw_triton  # Triton only where this optimizer is built

        self._kernels = adamw_triton
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True))
        self.grad_scale = self.found_inf = None
        members = [(index, master) for index, group in enumerate(self.param_groups) for master in group["params"]]
        self.device = members[0][1].device
        self._steps = torch.zeros(len(self.param_groups), dtype=torch.float64, device=self.device)
        self._grad_ptrs = [(master, grad.data_ptr()) for (_, master), (grad, _) in zip(members, sources, strict=True)]
        self._owned: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        by_key: dict[tuple, list] = {}
        for (index, master), (grad, param) in zip(members, sources, strict=True):
            by_key.setdefault(_launch_key(grad, master, param), []).append((index, master, grad, param))
        self._launches = [self._lay_out(entries) for entries in by_key.values()]
        self._laid_out = True

    def add_param_group(self, param_group: dict) -> None:
        """torch's, while the constructor adds its groups; afterwards a typed error (the flat
        layout and its tiles are made once, for the masters given at construction)."""
        if getattr(self, "_laid_out", False):
            raise FlatAdamWError(
                "FlatAdamW lays out its masters once, at construction: build a new optimizer to step more parameters"
            )
        super().add_param_group(param_group)

    def _lay_out(self, entries: list) -> _Launch:
        """Flat moments (and masters, when they are copies) for one launch's ``entries``, each
        piece starting at a multiple of the kernel's ``ALIGNMENT`` elements; the state views; the tiles."""
        alignment = self._kernels.ALIGNMENT
        offsets, total = [], 0
        for _, master, _, _ in entries:
            offsets.append(total)
            total += -(-master.numel() // alignment) * alignment
        copy = entries[0][1].dtype != entries[0][3].dtype
        moments = {name: torch.zeros(total, dtype=torch.float32, device=self.device) for name in _MOMENTS}
        flat_master = torch.empty(total, dtype=torch.float32, device=self.device) if copy else None
        pieces = []
        for (index, master, grad, param), offset in zip(entries, offsets, strict=True):
            numel = master.numel()
            if copy:  # the master moves into the flat tensor (same object: groups and callers keep it)
                flat_master[offset : offset + numel].copy_(master.reshape(-1))
                master.data = flat_master[offset : offset + numel].view(master.shape)
            state = {name: moments[name][offset : offset + numel].view(master.shape) for name in _MOMENTS}
            state["step"] = self._steps[index]
            self.state[master] = dict(state)
            self._owned[master] = state
            param_offset = param.storage_offset() if copy else 0
            master_offset = offset if copy else master.storage_offset()
            pieces.append((grad.storage_offset(), param_offset, master_offset, offset, numel, index))
        return _Launch(
            grad=_storage_tensor(entries[0][2]),
            param=_storage_tensor(entries[0][3]) if copy else None,
            master=flat_master if copy else _storage_tensor(entries[0][1]),
            exp_avg=moments["exp_avg"],
            exp_avg_sq=moments["exp_avg_sq"],
            tiles=self._kernels.tile_tables(pieces, self.device),
        )

    def _adopt_installed_state(self) -> None:
        """Copy state that replaced this optimizer's own tensors (a loaded state dict) into them."""
        for master, owned in self._owned.items():
            state = self.state[master]
            for name, tensor in owned.items():
                value = state.get(name)
                if value is tensor:
                    continue
                if value is None:
                    tensor.zero_()
                else:
                    tensor.copy_(value.reshape(tensor.shape) if torch.is_tensor(value) else torch.tensor(value))
                state[name] = tensor

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, then the loaded values copied into this optimizer's flat
        storage (so no tensor of ``state_dict`` stays aliased)."""
        super().load_state_dict(state_dict)
        self._adopt_installed_state()

    def _check_grads(self) -> None:
        for master, pointer in self._grad_ptrs:
            if master.grad is None or master.grad.data_ptr() != pointer:
                raise FlatAdamWError(
                    f"the gradient of a master of shape {tuple(master.shape)} is not the flat-buffer view FlatAdamW "
                    "was built with (set master.grad to the same view of DDP's main_grad before every step)"
                )

    def _coefficients(self) -> torch.Tensor:
        """Per group ``[lr / (1 - beta1^step), sqrt(1 - beta2^step), 1 - lr * wd, beta1, beta2,
        eps]`` in fp32, from the groups' current hyperparameters and the device step counts."""
        rows = [[g["lr"], g["weight_decay"], *g["betas"], g["eps"]] for g in self.param_groups]
        hyper = torch.tensor(rows, dtype=torch.float64)
        if self.device.type == "cuda":
            hyper = hyper.pin_memory()
        lr, weight_decay, beta1, beta2, eps = hyper.to(self.device, non_blocking=True).unbind(1)
        step_size = lr / (1 - beta1**self._steps)
        columns = [step_size, torch.sqrt(1 - beta2**self._steps), 1 - lr * weight_decay, beta1, beta2, eps]
        return torch.stack(columns, dim=1).float()

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every master (skipped, step counts included, where ``found_inf``
        is non-zero)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adopt_installed_state()
        self._check_grads()
        self._steps += 1
        coeffs = self._coefficients()
        for launch in self._launches:
            for aligned, tiles in launch.tiles.items():
                self._kernels.adamw_step(
                    tiles,
                    launch.grad,
                    launch.param,
                    launch.master,
                    launch.exp_avg,
                    launch.exp_avg_sq,
                    coeffs,
                    self.grad_scale,
                    self.found_inf,
                    aligned,
                )
        if self.found_inf is not None:
            self._steps -= self.found_inf.reshape(()).to(self._steps.dtype)
        return loss
