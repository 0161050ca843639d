"""One optimizer per MIMO module, chained, with every decision agreed over the whole job.

Each module has its own optimizer over its own collection (its grad norm sums over that
module's model-parallel group, its inf/nan check spans that module's ranks). Modules on
disjoint ranks never meet in those groups, so the chain adds one all-reduce over the job's
group per decision: a vector with one slot per module of the job, filled by the ranks that
hold the module (every holder computes the same value) and reduced with MAX. Every rank then
knows each module's overflow flag and squared norm, skips or steps together with the others,
and clips with the same global norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.optimizer import (
    ChainedOptimizer,
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    step_optimizers,
)
from megatron.core.optimizer.clip_grads import stats_device
from megatron.core.optimizer.optimizer_config import OptimizerConfigError


class MimoOptimizer(ChainedOptimizer):
    """The chain of the optimizers of the modules this rank holds.

    Args:
        optimizers: module name -> that module's optimizer, for the modules on this rank.
        module_names: every module of the job, in the same order on every rank.
        group: the process group spanning the job (default: the world).
    """

    def __init__(self, optimizers: dict[str, MegatronOptimizer], module_names: list[str], group=None):
        unknown = sorted(set(optimizers) - set(module_names))
        if unknown:
            raise OptimizerConfigError(f"optimizers for {unknown} are not among the job's modules {module_names}")
        super().__init__([optimizers[name] for name in module_names if name in optimizers])
        self.optimizers = {name: optimizers[name] for name in module_names if name in optimizers}
        self.module_names = list(module_names)
        self.group = group
        self.device = stats_device(group)

    def _agree(self, values: list[float]) -> list[float]:
        """Per module of the job, the value its holders computed (MAX over the job); ``values``
        has one entry per module on this rank, in chain order."""
        held = dict(zip(self.optimizers, values, strict=True))
        job_values = torch.zeros(len(self.module_names), dtype=torch.float64, device=self.device)
        for index, name in enumerate(self.module_names):
            if name in held:
                job_values[index] = held[name]
        dist.all_reduce(job_values, op=dist.ReduceOp.MAX, group=self.group)
        return job_values.tolist()

    def step(self) -> tuple[bool, float | None, int | None]:
        """``(update_successful, grad_norm, num_zeros_in_grad)``, identical on every rank of the job."""
        return step_optimizers(self.chained_optimizers, agree=self._agree)

    def state_dict(self) -> dict[str, dict]:
        """Module name -> its optimizer's state dict (modules on this rank)."""
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, dict]) -> None:
        missing = sorted(set(self.optimizers) - set(state_dict))
        if missing:
            raise OptimizerConfigError(f"optimizer state lacks modules {missing}; it holds {sorted(state_dict)}")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])


def get_mimo_optimizer(
    config: OptimizerConfig, modules: dict[str, torch.nn.Module], collections: dict, module_names: list[str], group=None
) -> MimoOptimizer:
    """Build each held module's optimizer over its own collection and chain them.

    ``modules`` and ``collections`` map the names of this rank's modules to their (DDP-wrapped)
    module and :class:`ProcessGroupCollection`."""
    optimizers = {name: get_megatron_optimizer(config, [modules[name]], collections[name]) for name in modules}
    return MimoOptimizer(optimizers, module_names, group)
