"""ModuleSpec / build_module."""

import pytest

from megatron.core.transformer.spec import ModuleSpec, ModuleSpecError, build_module


class Recorder:
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def test_spec_passes_params_submodules_and_call_arguments():
    built = build_module(ModuleSpec(Recorder, params={"a": 1, "b": 2}, submodules="subs"), 7, b=3)
    assert built.args == (7,)
    assert built.kwargs == {"a": 1, "b": 3, "submodules": "subs"}  # call arguments override params


def test_bare_class_or_callable_is_called_directly():
    assert build_module(Recorder, 1, x=2).kwargs == {"x": 2}
    assert build_module(lambda x: x + 1, 1) == 2


def test_unbuildable_spec_names_what_it_got():
    with pytest.raises(ModuleSpecError, match="cannot build a module from 3 \\(type int\\)"):
        build_module(3)
