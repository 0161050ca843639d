"""The package's layering and entry points: nothing under megatron/core (and no inference or
serving entry point) imports megatron.training, every megatron.core module imports with it
made unimportable, the commands are console scripts and ``python -m`` modules whose scripts
under examples/ and tools/ are thin wrappers, and no script directory manipulates sys.path or
holds a file named like a standard-library module."""

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from tests.readme import ROOT, command_env

COMMANDS = {
    "megatron-pretrain-gpt": "megatron.training.pretrain_gpt:main",
    "megatron-pretrain-hybrid": "megatron.training.pretrain_hybrid:main",
    "megatron-serve": "megatron.core.inference.server.launcher:main",
    "megatron-convert": "megatron.core.models.checkpoint_converter:main",
    "megatron-inspect-ckpt": "megatron.core.dist_checkpointing.inspect_checkpoint:main",
    "megatron-preprocess-data": "megatron.core.datasets.preprocess_data:main",
}
INFERENCE_ENTRY_POINTS = [
    *sorted((ROOT / "examples" / "inference").glob("*.py")),
    ROOT / "tools" / "run_text_generation_server.py",
    *sorted((ROOT / "tools" / "checkpoint").glob("*.py")),
]
SCRIPT_DIRECTORIES = ("examples", "tools", "benchmarks")


def test_nothing_under_core_and_no_inference_entry_point_names_megatron_training():
    files = [*sorted((ROOT / "megatron" / "core").rglob("*.py")), *INFERENCE_ENTRY_POINTS]
    assert len(files) > 150
    assert [str(f.relative_to(ROOT)) for f in files if "megatron.training" in f.read_text()] == []


IMPORT_EVERYTHING = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, runpy, sys

    class NoTraining(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "megatron.training" or name.startswith("megatron.training."):
                raise ImportError(f"{name} must not be imported here")
            return None

    sys.meta_path.insert(0, NoTraining())
    import megatron.core

    names = [m.name for m in pkgutil.walk_packages(megatron.core.__path__, "megatron.core.")]
    for name in names:
        importlib.import_module(name)
    for path in sys.argv[1:]:
        runpy.run_path(path, run_name="imported")  # the entry point's imports, not its main
    assert not any(m.startswith("megatron.training") for m in sys.modules)
    print(len(names), "modules")
    """
)


def test_every_core_module_and_inference_entry_point_imports_without_megatron_training():
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING, *map(str, INFERENCE_ENTRY_POINTS)],
        cwd=ROOT,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) > 150


def test_no_script_directory_or_test_manipulates_sys_path():
    pattern = re.compile(r"\bsys\.path\b")
    files = [f for d in (*SCRIPT_DIRECTORIES, "tests") for f in (ROOT / d).rglob("*.py")]
    this_file = Path(__file__).resolve()
    offenders = [str(f.relative_to(ROOT)) for f in files if f.resolve() != this_file and pattern.search(f.read_text())]
    assert offenders == []


def test_no_script_is_named_like_a_standard_library_module():
    """A script's directory is sys.path[0] when it runs: a file there named like a standard
    module shadows it for every import (tools/checkpoint/inspect.py broke convert.py so)."""
    scripts = [f for d in SCRIPT_DIRECTORIES for f in (ROOT / d).rglob("*.py")]
    assert [str(f.relative_to(ROOT)) for f in scripts if f.stem in sys.stdlib_module_names] == []


def test_commands_are_console_scripts_and_python_m_modules():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == COMMANDS
    for target in COMMANDS.values():
        module, function = target.split(":")
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert f"def {function}(" in source and 'if __name__ == "__main__":' in source, module


def test_the_converter_script_runs_from_the_checkout():
    """``python tools/checkpoint/convert.py`` once failed at import (a sibling file shadowed
    the standard ``inspect``)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py"), "--help"],
        cwd=ROOT,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: megatron-convert "), done.stderr
