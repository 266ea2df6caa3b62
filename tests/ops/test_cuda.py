"""The operator on CUDA: same outputs and gradients as on the CPU, and no host
synchronisation in the hot path (``torch.cuda.set_sync_debug_mode("error")``).
Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch
from torch_geometric.data import Batch

import hsa_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARENTS = [
    [-1] + [0] * 4 + [1 + i // 4 for i in range(16)],
    [-1, 0, 0] + [1] * 17 + [2] * 3 + [0],
    [-1, 0, 1, 1, 0, 4, 0] + [1] * 3,
]


def _inputs(n, m, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(n, 2, dv, generator=gen, dtype=torch.float64)
    pos = torch.randn(m, 3, generator=gen, dtype=torch.float64)
    return q, k, v, pos


@pytest.mark.parametrize("use_pos", [False, True])
@pytest.mark.parametrize("dv", [8, 5])
@pytest.mark.parametrize("include_self", [True, False])
def test_cuda_matches_cpu(include_self, dv, use_pos):
    trees = [hsa_graph.NestedSignal.from_parents(p) for p in PARENTS]
    batch = Batch.from_data_list(trees)
    st = batch.structure
    q, k, v, pos = _inputs(st.num_leaves, st.num_nodes, dv)
    pos = pos if use_pos else None
    results = []
    for device in ("cpu", "cuda"):
        args = [t.to(device).requires_grad_() for t in (q, k, v)]
        p = None if pos is None else pos.to(device).requires_grad_()
        y = hsa_graph.hsa(*args, batch.to(device), include_self=include_self, pos=p)
        grads = torch.autograd.grad(y.square().sum(), args + ([p] if p is not None else []))
        results.append([y.cpu()] + [g.cpu() for g in grads])
    for cpu, cuda in zip(*results):
        torch.testing.assert_close(cuda, cpu, rtol=1e-8, atol=1e-10)


def test_no_host_sync_on_cuda():
    tree = hsa_graph.NestedSignal.from_parents(PARENTS[1]).to("cuda")
    st = tree.structure_for(torch.device("cuda"))  # built (and validated) beforehand
    q, k, v, pos = (t.float().cuda() for t in _inputs(st.num_leaves, st.num_nodes, 8))
    q.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = hsa_graph.hsa(q, k, v, st, pos=pos)
        y.sum().backward()
        hsa_graph.hsa(q, k, v, st, include_self=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(y).all()
