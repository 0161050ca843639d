"""The fused-op backend switch: auto picks Triton only on CUDA, a forced backend wins over
the environment, and bad names or an impossible Triton request fail with a typed error that
names what is accepted."""

import pytest
import torch

from megatron.core.fusions import (
    BACKEND_ENV,
    FUSED_OPS,
    FusionBackendError,
    fused_backend,
    fusion_backend,
    set_fusion_backend,
)
from tests.unit_tests.fusions.kernels import DEVICE

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_runs_triton_on_cuda_and_torch_elsewhere(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert fused_backend("norm", CPU) == "torch"
    assert fused_backend("cross_entropy", CUDA) == "triton"


def test_environment_then_setting_choose_the_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert fused_backend("rope", CUDA) == "torch"
    with fusion_backend("auto"):
        assert fused_backend("rope", CUDA) == "triton"
    assert fused_backend("rope", CUDA) == "torch"


def test_forced_triton_runs_on_the_kernels_device():
    with fusion_backend("triton"):
        assert {fused_backend(op, DEVICE) for op in FUSED_OPS} == {"triton"}


def test_disabled_ops_take_torch():
    with fusion_backend("triton", disabled_ops=["rope"]):
        assert fused_backend("rope", DEVICE) == "torch"
        assert fused_backend("norm", DEVICE) == "triton"


def test_unknown_backend_is_refused_with_the_accepted_names(monkeypatch):
    with pytest.raises(FusionBackendError, match=r"fusion backend 'cudnn' is unknown; accepted: auto, torch, triton"):
        set_fusion_backend("cudnn")
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(FusionBackendError, match=rf"'fast' is unknown; accepted: auto, torch, triton .*{BACKEND_ENV}"):
        fused_backend("norm", CPU)


def test_unknown_op_names_are_refused():
    with pytest.raises(FusionBackendError, match=r"unknown fused ops \['softmax'\]; the fused ops are norm, "):
        set_fusion_backend("auto", disabled_ops=["softmax"])
    with pytest.raises(FusionBackendError, match=r"unknown fused op 'gemm'"):
        fused_backend("gemm", CPU)


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with fusion_backend("triton"), pytest.raises(FusionBackendError, match=r"needs CUDA tensors \(got cpu\)"):
        fused_backend("norm", CPU)
