"""Every worked example in the package's docstrings (`>>>`) runs and says what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import dapo_ray

MODULES = sorted(m.name for m in pkgutil.walk_packages(dapo_ray.__path__, "dapo_ray."))


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), report=True)
    assert result.failed == 0
