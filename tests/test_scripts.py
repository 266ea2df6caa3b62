"""The repository's scripts (benchmarks, examples) parse their options as the package's
commands do: no prefix of an option may stand for another (``--seed`` for ``--seeds``)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for folder in ("benchmarks", "examples") for p in (ROOT / folder).glob("*.py"))


def argument_parsers(path: Path):
    """Every ``argparse.ArgumentParser(...)`` call in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "ArgumentParser"):
            yield node


def test_the_scan_finds_the_scripts_parsers():
    assert sum(1 for path in SCRIPTS for _ in argument_parsers(path)) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_script_parser_allows_abbreviations(path):
    for call in argument_parsers(path):
        flags = {k.arg: k.value for k in call.keywords}
        assert "allow_abbrev" in flags and isinstance(flags["allow_abbrev"], ast.Constant) \
            and flags["allow_abbrev"].value is False, f"{path.name}:{call.lineno}"
