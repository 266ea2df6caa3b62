"""The fused CPU step kernel (hsa_graph.ops.step_kernel): the same states and outputs as
the eager step over random lives of a batched cache, and the rules for when it runs.
(tests/ops/test_cache.py runs every cache test with both paths against causal_hsa.)"""
from __future__ import annotations

import random
import sys

import pytest
import torch

import hsa_graph.typing
from hsa_graph.ops import cache as cache_module
from hsa_graph.ops.cache import BatchedHSACache

pytest.importorskip("numba")


def _life(seed: int, dtype: torch.dtype, include_self: bool, fused: bool, monkeypatch):
    """A random life of a batch: random depths and attaches per sequence (levels close,
    widths grow), a drop and an add midway; returns the outputs and the final state."""
    monkeypatch.setattr(hsa_graph.typing, "WITH_NUMBA", fused)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cache = BatchedHSACache(3, include_self=include_self)
    depth = [None] * 3
    outs = []
    for t in range(60):
        if t == 30:
            cache.drop(1)
            cache.add(1)
            depth = [depth[0], depth[2], None]
        attach, new_depth = [], []
        for r in range(3):
            if depth[r] is None:
                d = rng.randint(1, 4)
                attach.append(None)
                new_depth.append(d)
            else:
                d = rng.randint(1, 4) if rng.random() < 0.2 else depth[r]
                attach.append(rng.randint(0, min(depth[r], d) - 1))
                new_depth.append(d)
            depth[r] = d
        q, k = (torch.randn(3, 2, 5, generator=g).to(dtype) for _ in range(2))
        v = torch.randn(3, 2, 3, generator=g).to(dtype)
        outs.append(cache.step(q, k, v, attach=attach, depth=new_depth))
    return torch.stack(outs), cache._state.tensors()


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("seed", range(3))
def test_fused_step_equals_eager_step(seed, dtype, tol, include_self, monkeypatch):
    y_fused, state_fused = _life(seed, dtype, include_self, True, monkeypatch)
    y_eager, state_eager = _life(seed, dtype, include_self, False, monkeypatch)
    assert y_fused.dtype == dtype and torch.isfinite(y_fused).all()
    torch.testing.assert_close(y_fused, y_eager, atol=tol, rtol=tol)
    for name, t in state_fused.items():
        e = state_eager[name]
        if name == "base":
            # slots beyond a level's count hold stale G values that no step reads
            # (their size is 0); compare the live ones
            live = (state_fused["size"] > 0).unsqueeze(2).expand_as(t)
            t, e = t[live], e[live]
        torch.testing.assert_close(t, e, atol=tol, rtol=tol, msg=name)


def test_fused_step_is_used_where_it_applies(monkeypatch):
    monkeypatch.setattr(hsa_graph.typing, "WITH_NUMBA", True)
    x = torch.randn(2, 2, 4)
    assert cache_module._fused_step_kernel(x, x, x) is not None
    assert cache_module._fused_step_kernel(x.double(), x.double(), x.double()) is not None
    # autograd records: the eager step, whose graph is kept
    w = x.clone().requires_grad_()
    assert cache_module._fused_step_kernel(w, x, x) is None
    with torch.no_grad():
        assert cache_module._fused_step_kernel(w, x, x) is not None
    monkeypatch.setattr(hsa_graph.typing, "WITH_NUMBA", False)
    assert cache_module._fused_step_kernel(x, x, x) is None
    # half-precision tokens run in float32 (the compute dtype), so the kernel applies
    monkeypatch.setattr(hsa_graph.typing, "WITH_NUMBA", True)
    calls = []
    real = cache_module._load_step_kernel()

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(cache_module, "_load_step_kernel", lambda: counting)
    cache = BatchedHSACache(2)
    h = torch.randn(2, 2, 4, dtype=torch.bfloat16)
    y = cache.step(h, h, h, depth=2)
    assert calls and y.dtype == torch.bfloat16


def test_a_numba_that_cannot_be_imported_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(hsa_graph.typing, "WITH_NUMBA", True)
    monkeypatch.setitem(sys.modules, "hsa_graph.ops.step_kernel", None)  # import fails
    cache_module._load_step_kernel.cache_clear()
    try:
        x = torch.randn(1, 2, 4, dtype=torch.float64)
        with pytest.warns(RuntimeWarning, match="eager path"):
            y = BatchedHSACache(1).step(x, x, x, depth=1)
        torch.testing.assert_close(y, x)  # one token attends to itself
    finally:
        cache_module._load_step_kernel.cache_clear()


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_a_nan_token_spreads_to_every_output_that_reads_it(which, include_self, monkeypatch):
    """Without ``check_finite`` a NaN token is not checked: it must reach every output
    that reads it (never be dropped silently) and leave the other sequences and heads
    alone. Its key and value are read by every later query (through the logits and
    values of the family that completes over it); its query only by the rows of its
    own open family, until that family completes at the root, where its mean query
    enters only the root's lambda, which no output reads. There the eager step gives
    NaN anyway (a matmul multiplies the root's left sums by zero), the kernel the
    defined value."""
    results = []
    for fused in (True, False):
        monkeypatch.setattr(hsa_graph.typing, "WITH_NUMBA", fused)
        g = torch.Generator().manual_seed(4)
        cache = BatchedHSACache(2, include_self=include_self)
        outs = []
        for t in range(12):
            tokens = dict(zip("qkv", (torch.randn(2, 2, 4, generator=g, dtype=torch.float64)
                                      for _ in range(3))))
            if t == 5:
                tokens[which][1, 0, 0] = float("nan")
            outs.append(cache.step(**tokens, depth=2 if t == 0 else None,
                                   attach=0 if t % 4 == 3 else None))
        results.append(torch.stack(outs))
    fused, eager = results
    # [steps, Dv] where the NaN is; a value's feature reaches that feature alone
    head = fused[:, 1, 0, :1] if which == "v" else fused[:, 1, 0]
    # without include_self a token's own value is read from the next step on
    first = 6 if which == "v" and not include_self else 5
    reads = slice(first, None) if which != "q" else slice(5, 7)
    assert torch.isnan(head[reads]).all()
    torch.testing.assert_close(fused[:5], eager[:5], atol=1e-12, rtol=1e-12)
    if which != "q":
        torch.testing.assert_close(fused, eager, atol=1e-12, rtol=1e-12, equal_nan=True)
    assert torch.isfinite(fused[:, 0]).all() and torch.isfinite(fused[:, 1, 1]).all()
