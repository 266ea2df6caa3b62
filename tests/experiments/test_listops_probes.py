"""The probe sets of examples/listops_probes.py: the shapes they promise, in LRA's format."""
from __future__ import annotations

import pytest
from examples_loader import example_module

from hsa_graph.datasets.listops import parse_listops, read_listops_tsv


@pytest.fixture(scope="module")
def probes():
    with example_module("listops_probes.py") as module:
        yield module


def _arguments(expression: str):
    """The root's arguments, each as its list of tokens."""
    words, out, depth = expression.split()[1:-1], [], 0
    for word in words:
        if depth == 0:
            out.append([])
        out[-1].append(word)
        depth += word.startswith("[") - (word == "]")
    return out


@pytest.mark.parametrize("name", ["equal", "varied", "mixed"])
def test_each_probe_is_a_sum_over_operators_of_its_kind(probes, name):
    rows = probes.probe_examples(name, 300, seed=1)
    assert len({e for e, _ in rows}) == 300
    operators, low, high = probes.PROBES[name]
    sizes, ops = set(), set()
    for expression, label in rows:
        assert parse_listops(expression).value == label
        assert expression.startswith("[SM ")
        arguments = _arguments(expression)
        assert 2 <= len(arguments) <= 6
        for argument in arguments:
            assert argument[0][1:] in operators and argument[-1] == "]"
            digits = argument[1:-1]
            assert all(d.isdigit() for d in digits)  # one level of nesting only
            sizes.add(len(digits))
            ops.add(argument[0][1:])
    assert sizes == set(range(low, high + 1)) and ops == set(operators)
    # labels spread over the ten classes (a sum modulo 10)
    assert len({label for _, label in rows}) == 10


def test_probes_are_deterministic_by_seed(probes):
    draw = probes.probe_examples
    assert draw("varied", 50, seed=3) == draw("varied", 50, seed=3)
    assert draw("varied", 50, seed=3) != draw("varied", 50, seed=4)
    with pytest.raises(ValueError, match="unknown probe 'sum'"):
        probes.probe_examples("sum", 10)


def test_write_probes_writes_three_disjoint_lra_splits(probes, tmp_path, monkeypatch):
    monkeypatch.setattr(probes, "SPLITS", (("train", 40), ("val", 5), ("test", 10)))
    written = probes.write_probes(tmp_path, seed=0)
    assert len(written) == 9
    for name in probes.PROBES:
        splits = {s: read_listops_tsv(tmp_path / name / f"basic_{s}.tsv", check=True)
                  for s in ("train", "val", "test")}
        assert [len(splits[s]) for s in ("train", "val", "test")] == [40, 5, 10]
        expressions = [e for rows in splits.values() for e, _ in rows]
        assert len(set(expressions)) == 55
