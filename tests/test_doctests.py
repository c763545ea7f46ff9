"""Every docstring example of satjax's modules and of the scripts runs and is right; the
modules users import the losses from must have examples (optax's rule: each public
function shows its use)."""

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import satjax

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(m.name for m in pkgutil.walk_packages(satjax.__path__, "satjax.")
                 if not m.name.endswith(("__main__", "_pb2", "_pb2_grpc")))
WITH_EXAMPLES = {
    "satjax.losses.advantages", "satjax.losses.corrections", "satjax.losses.hparams",
    "satjax.losses.policy_gradient", "satjax.losses.quantile", "satjax.losses.regularizers",
    "satjax.losses.sat", "satjax.objectives",
}
SCRIPTS = sorted(p for d in ("scripts", "benchmarks") for p in (REPO / d).glob("*.py")
                 if ">>> " in p.read_text())


def _check(module, required: bool) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.attempted > 0 or not required, f"{module.__name__} has no docstring examples"
    assert result.failed == 0


def test_the_modules_that_must_have_examples_exist():
    assert WITH_EXAMPLES <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    _check(importlib.import_module(module), module in WITH_EXAMPLES)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_docstring_examples(path):
    spec = importlib.util.spec_from_file_location(f"_doctest_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _check(module, True)
