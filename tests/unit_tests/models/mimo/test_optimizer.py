"""The MIMO optimizer chain agrees on grad norm and inf/nan over modules on disjoint ranks."""

import pytest
import torch

from megatron.core.models.mimo import LANGUAGE_MODEL, MimoOptimizer, MimoRoles, get_mimo_optimizer
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer_config import OptimizerConfigError
from tests.unit_tests.dist_harness import run_distributed

# Gradients: images (rank 0) has norm 3, the language model (ranks 1-2, identical DP
# replicas) norm 4; counted once each, the job's norm is 5.
GRADS = {"images": [[3.0, 0.0], [0.0, 0.0]], LANGUAGE_MODEL: [[0.0, 4.0], [0.0, 0.0]]}


def _step(poison_images: bool):
    roles = MimoRoles.build(3, language={}, modalities={"images": {}}, placement="first-1")
    collections = roles.build_collections()
    modules = {}
    for name in collections:
        module = torch.nn.Linear(2, 2, bias=False)
        torch.nn.init.ones_(module.weight)
        module.weight.grad = torch.tensor(GRADS[name])
        if poison_images and name == "images":
            module.weight.grad[1, 1] = float("nan")
        modules[name] = module
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0)
    optimizer = get_mimo_optimizer(config, modules, collections, [LANGUAGE_MODEL, "images"])
    ok, norm, _ = optimizer.step()
    (module,) = modules.values()
    return ok, norm, module.weight.detach().clone()


def test_grad_norm_counts_each_module_once_over_the_whole_job():
    results = run_distributed(_step, 3, False)
    for rank, (ok, norm, weight) in enumerate(results):
        assert ok and norm == pytest.approx(5.0)
        name = "images" if rank == 0 else LANGUAGE_MODEL
        torch.testing.assert_close(weight, torch.ones(2, 2) - torch.tensor(GRADS[name]))


def test_nan_on_one_module_skips_the_step_on_every_rank():
    results = run_distributed(_step, 3, True)
    for ok, norm, weight in results:
        assert (ok, norm) == (False, None)
        torch.testing.assert_close(weight, torch.ones(2, 2))


def test_optimizers_must_belong_to_the_job():
    with pytest.raises(OptimizerConfigError, match=r"optimizers for \['audio'\] are not among the job's modules"):
        MimoOptimizer({"audio": object()}, [LANGUAGE_MODEL, "images"])
