"""Every exception class of the package derives from MegatronError through one family:
configuration and input errors are ValueErrors, runtime faults are not."""

import ast
import builtins
import importlib
import inspect
import pathlib
import pkgutil

import pytest

import megatron
import megatron.core
from megatron.core.errors import MegatronConfigError, MegatronError, MegatronInputError, MegatronRuntimeError

ROOT = pathlib.Path(__file__).parents[2]
VALUE_FAMILIES = (MegatronConfigError, MegatronInputError)


def _package_exception_classes() -> dict[str, type]:
    """``{"module.Class": class}`` of every BaseException subclass defined under megatron/."""
    found = {}
    for info in pkgutil.walk_packages(megatron.__path__, "megatron."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


CLASSES = _package_exception_classes()
FAMILIES = {MegatronError, MegatronConfigError, MegatronInputError, MegatronRuntimeError}
# Roots of the errors answered to remote clients: neither is raised as such. Concrete
# InferenceRequestErrors are input or runtime errors; an APIError's status says whose fault it is.
REPLY_ROOTS = {"megatron.core.inference.errors.InferenceRequestError", "megatron.core.inference.server.errors.APIError"}
# The runtime faults the design names: none of them may be caught as a bad value.
RUNTIME_FAULTS = [
    "megatron.core.inference.coordinator.coordinator.EngineLostError",
    "megatron.core.inference.coordinator.coordinator.CoordinatorStoppedError",
    "megatron.core.inference.coordinator.client.ClientClosedError",
    "megatron.core.inference.coordinator.messages.ProtocolError",
    "megatron.core.inference.handoff.transport.TransportError",
    "megatron.core.inference.handoff.failures.TransferSubmitError",
    "megatron.core.inference.handoff.failures.TransferFailedError",
    "megatron.core.inference.contexts.errors.CapacityNegotiationTimeoutError",
    "megatron.core.inference.server.serve.ServerStartError",
    "megatron.core.dist_checkpointing.errors.CorruptCheckpointError",
    "megatron.core.dist_checkpointing.errors.CheckpointIOError",
    "megatron.core.distributed.param_and_grad_buffer.GradSyncOrderError",
]
CONFIG_ERRORS = [
    "megatron.training.arguments.ArgumentError",
    "megatron.core.config.ConfigError",
    "megatron.core.process_groups.ParallelConfigError",
    "megatron.core.transformer.spec.ModuleSpecError",
    "megatron.core.transformer.transformer_block.PipelineLayoutError",
    "megatron.core.models.hybrid.hybrid_layer_pattern.HybridPatternError",
] + [name for name in CLASSES if name.endswith("ConfigError")]


def test_the_walk_finds_the_package_classes():
    assert len(CLASSES) > 50
    assert set(RUNTIME_FAULTS + CONFIG_ERRORS + sorted(REPLY_ROOTS)) <= set(CLASSES)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_exception_class_is_in_one_family(name):
    cls = CLASSES[name]
    assert issubclass(cls, MegatronError), f"{name} does not derive from MegatronError"
    if cls in FAMILIES or name in REPLY_ROOTS:
        return
    is_value = issubclass(cls, VALUE_FAMILIES)
    is_runtime = issubclass(cls, MegatronRuntimeError)
    assert is_value != is_runtime, f"{name} must be a config/input error or a runtime fault, exactly one"
    if is_value:
        assert issubclass(cls, ValueError)
    else:
        assert not issubclass(cls, ValueError) and issubclass(cls, RuntimeError)


@pytest.mark.parametrize("name", RUNTIME_FAULTS)
def test_runtime_faults_are_not_value_errors(name):
    cls = CLASSES[name]
    assert issubclass(cls, MegatronRuntimeError) and not issubclass(cls, ValueError)


@pytest.mark.parametrize("name", sorted(set(CONFIG_ERRORS)))
def test_configuration_errors_are_value_errors(name):
    cls = CLASSES[name]
    assert issubclass(cls, MegatronConfigError) and issubclass(cls, ValueError)


def test_class_names_are_unique_so_wire_types_are_unambiguous():
    by_name = {}
    for name, cls in CLASSES.items():
        by_name.setdefault(cls.__name__, []).append(name)
    assert {short: where for short, where in by_name.items() if len(where) > 1} == {}


def test_the_root_and_families_are_exported_from_megatron_core():
    for family in FAMILIES:
        assert getattr(megatron.core, family.__name__) is family


def _script_exception_bases():
    """``(file, class, base)`` for every class defined in tools/ and examples/ scripts whose base
    is an exception, resolved from the file's ``from megatron... import`` lines (scripts are read,
    not run)."""
    for path in sorted([*ROOT.glob("tools/**/*.py"), *ROOT.glob("examples/**/*.py")]):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                for alias in node.names:
                    imported[alias.asname or alias.name] = (node.module, alias.name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                if not isinstance(base, ast.Name):
                    continue
                if base.id in imported:
                    module, attr = imported[base.id]
                    resolved = getattr(importlib.import_module(module), attr)
                else:
                    resolved = getattr(builtins, base.id, None)
                if inspect.isclass(resolved) and issubclass(resolved, BaseException):
                    yield f"{path.relative_to(ROOT)}:{node.name}", resolved


def test_exception_classes_of_tools_and_examples_derive_from_the_root_too():
    # The scripts are thin wrappers over package code today and define none; one added later
    # must still join the hierarchy.
    found = dict(_script_exception_bases())
    assert {where: base for where, base in found.items() if not issubclass(base, MegatronError)} == {}
