"""Module specs: describe which class builds a sub-module (and with what extra arguments)
so implementations can be swapped (local torch vs fused kernels) without touching models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron.core.errors import MegatronConfigError


class ModuleSpecError(MegatronConfigError):
    """A spec that cannot be built: not a ModuleSpec, a class or a callable."""


@dataclass
class ModuleSpec:
    """What to build: ``module`` (a class or factory), fixed keyword ``params`` and the
    ``submodules`` description passed on to it as ``submodules=`` (usually a dataclass of
    further specs)."""

    module: type | Any
    params: dict = field(default_factory=dict)
    submodules: Any = None


def build_module(spec_or_cls, *args, **kwargs):
    """Instantiate ``spec_or_cls``.

    A ModuleSpec builds ``spec.module(*args, **spec.params, **kwargs)`` and adds
    ``submodules=spec.submodules`` when the spec has submodules; a bare class or callable is
    called with ``*args, **kwargs``. Keyword arguments given here override ``spec.params``.
    """
    if isinstance(spec_or_cls, ModuleSpec):
        params = {**spec_or_cls.params, **kwargs}
        if spec_or_cls.submodules is not None:
            params.setdefault("submodules", spec_or_cls.submodules)
        return spec_or_cls.module(*args, **params)
    if callable(spec_or_cls):
        return spec_or_cls(*args, **kwargs)
    raise ModuleSpecError(
        f"cannot build a module from {spec_or_cls!r} (type {type(spec_or_cls).__name__}); "
        "expected a ModuleSpec, a class or a callable"
    )
