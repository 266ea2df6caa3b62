"""``hsa`` under ``torch.compile``: it traces as one graph (``fullgraph=True``) and
gives the eager result, forward and backward.

The ``aot_eager`` backend runs dynamo and AOT autograd (what breaks graphs or
functionalisation) without a C++ toolchain, so the test stays fast; the inductor
backend and its timings are in ``benchmarks/bench_issue9.py``.
"""
from __future__ import annotations

import pytest
import torch

import hsa_graph

PARENTS = [
    [-1] + [0] * 4 + [1 + i // 4 for i in range(16)],  # contiguous leaf families
    [-1, 0, 0] + [1] * 17 + [2] * 3 + [0],  # padding, mixed family, a lonely leaf path
]


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("parent", PARENTS)
def test_compiled_hsa_equals_eager(parent, include_self):
    torch._dynamo.reset()
    tree = hsa_graph.NestedSignal.from_parents(parent)
    st = tree.structure
    gen = torch.Generator().manual_seed(0)
    n = st.num_leaves
    q, k, v = (torch.randn(n, 2, 8, generator=gen, requires_grad=True) for _ in range(3))

    def fn(a, b, c):
        return hsa_graph.hsa(a, b, c, st, include_self=include_self)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    y = compiled(q, k, v)
    # what the trace left on the structure (fields built while tracing, which dynamo
    # stores as outputs of the graph) stays out of autograd: a tensor of it that
    # required grad would tie every later call to this call's graph
    kept = [t for t in (*vars(st).values(), *vars(st).get("_constants", {}).values())
            if isinstance(t, torch.Tensor)]
    assert not any(t.requires_grad for t in kept)
    ref = fn(q, k, v)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(y.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("parent", PARENTS + [[-1, 0, 0] + [1] * 5 + [2] * 9])
@pytest.mark.parametrize("width", [8, 16])
def test_no_graph_breaks(parent, width):
    """Also at widths where eager calls without autograd take the compiled C kernel
    (16), and on trees whose families of leaves hold leaves alone: no layout question
    is asked of a tensor while tracing."""
    torch._dynamo.reset()
    st = hsa_graph.NestedSignal.from_parents(parent).structure
    x = torch.randn(st.num_leaves, 2, width)
    explain = torch._dynamo.explain(lambda a: hsa_graph.hsa(a, a, a, st))(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
