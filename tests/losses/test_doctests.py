"""Every docstring example of satjax.losses and satjax.objectives runs and is right."""

import doctest
import importlib

import pytest

MODULES = [
    "satjax.losses.advantages", "satjax.losses.corrections", "satjax.losses.hparams",
    "satjax.losses.policy_gradient", "satjax.losses.quantile", "satjax.losses.regularizers",
    "satjax.losses.sat",
    "satjax.objectives",
]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS,
                             report=True)
    assert result.attempted > 0, f"{module} has no docstring examples"
    assert result.failed == 0
