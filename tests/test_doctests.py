"""The examples in the package's docstrings run and give what they show."""
import doctest
import importlib
import pkgutil

import pytest

import hsa_graph

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(hsa_graph.__path__, "hsa_graph."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                             extraglobs={"torch": importlib.import_module("torch")})
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
