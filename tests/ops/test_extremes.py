"""Numerical extremes of hsa / hsa_weights (SPEC property 9): logits of magnitude up to
1e5 in float32, float16 and bfloat16 inputs, ties at huge logits, finite gradients; and
NaN / inf inputs, rejected with ``check_finite=True`` or contained in their own tree.

The reference is tests/reference.py (independent, written from SPEC.md) in float64 on
the very same (rounded) inputs, so the tolerances measure only the computation."""
from __future__ import annotations

import inspect

import pytest
import torch
from reference import dense_hsa, dense_hsa_weights
from torch_geometric.data import Batch

from hsa_graph import NestedSignal, hsa, hsa_weights

# Deep and wide at once: families of 2, 3 and 4, a unary node (12 -> 13), leaves at
# several depths.
PARENT = [-1, 0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 1, 12, 13, 13]
EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def inputs(magnitude: float, dtype: torch.dtype, seed: int = 0, heads: int = 2, d: int = 4):
    """q, k with logits ``scale * <q_i, k_j>`` of about ``magnitude`` (scale 1/2), v."""
    tree = NestedSignal.from_parents(PARENT)
    n = tree.num_leaves
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, heads, 3, generator=g, dtype=torch.float64)
    root = (2 * magnitude) ** 0.5 / d ** 0.5
    return tree, (q * root).to(dtype), (k * root).to(dtype), v.to(dtype)


def tolerance(magnitude: float, dtype: torch.dtype, v: torch.Tensor) -> float:
    # Half inputs are computed in float32. Logits, and the log-masses lam averaged from
    # them, carry an absolute error of about magnitude * eps32, so weights carry a
    # relative one as large; the output is rounded to the input dtype once.
    vmax = float(v.abs().max())
    return (4 * EPS[torch.float32] * max(magnitude, 1.0) + 4 * EPS[dtype]) * vmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1.0, 1e2, 1e4])
@pytest.mark.parametrize("include_self", [True, False])
def test_large_logits_match_float64_reference(dtype, magnitude, include_self):
    tree, q, k, v = inputs(magnitude, dtype)
    y = hsa(q, k, v, tree, include_self=include_self, scale=0.5)
    assert y.dtype == dtype and bool(torch.isfinite(y).all())
    ref = dense_hsa(PARENT, q.double(), k.double(), v.double(), include_self=include_self,
                    scale=0.5)
    torch.testing.assert_close(y.double(), ref, rtol=0,
                               atol=tolerance(magnitude, dtype, v))
    theta = hsa_weights(q, k, tree, include_self=include_self, scale=0.5)
    assert bool(torch.isfinite(theta).all())
    ref_theta = dense_hsa_weights(PARENT, q.double(), k.double(), include_self=include_self,
                                  scale=0.5)
    torch.testing.assert_close(theta.double(), ref_theta, rtol=0,
                               atol=tolerance(magnitude, dtype, torch.ones(1)))


def test_float32_logits_1e5_stay_finite_and_stochastic():
    tree, q, k, v = inputs(1e5, torch.float32)
    theta = hsa_weights(q, k, tree, scale=0.5)
    assert bool(torch.isfinite(theta).all())
    torch.testing.assert_close(theta.sum(-1), torch.ones(2, tree.num_leaves), rtol=0,
                               atol=tolerance(1e5, torch.float32, torch.ones(1)))
    rows = hsa(q, k, torch.ones_like(v), tree, scale=0.5)   # y = row sums of theta
    torch.testing.assert_close(rows, torch.ones_like(rows), rtol=0,
                               atol=tolerance(1e5, torch.float32, torch.ones(1)))
    ref = dense_hsa(PARENT, q.double(), k.double(), v.double(), scale=0.5)
    torch.testing.assert_close(hsa(q, k, v, tree, scale=0.5).double(), ref, rtol=0,
                               atol=tolerance(1e5, torch.float32, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ties_at_huge_logits(dtype):
    """Every logit equal and huge (q = k = one large vector, logits 2e4): on a flat
    tree every row of theta is uniform; on the deep tree the output is what the
    float64 reference gives (the log-masses are averages of 2e4-sized numbers, so
    float32 rounding enters there)."""
    tree = NestedSignal.from_parents(PARENT)
    n = tree.num_leaves
    q = torch.full((n, 1, 4), 100.0, dtype=dtype)   # logits 0.5 * 4 * 1e4 = 2e4
    v = torch.randn(n, 1, 3).to(dtype)
    y = hsa(q, q, v, tree, scale=0.5)
    ref = dense_hsa(PARENT, q.double(), q.double(), v.double(), scale=0.5)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=tolerance(2e4, dtype, v))
    flat = NestedSignal.from_parents([-1] + [0] * n)
    theta = hsa_weights(q, q, flat, scale=0.5)[0].float()
    torch.testing.assert_close(theta, torch.full((n, n), 1.0 / n), rtol=0,
                               atol=tolerance(2e4, dtype, torch.ones(1)) / n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_gradients_stay_finite_at_extremes(dtype, magnitude):
    tree, q, k, v = inputs(magnitude, dtype)
    for include_self in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = hsa(*leaves, tree, include_self=include_self, scale=0.5)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        for name, t in zip("qkv", leaves):
            assert t.grad is not None and bool(torch.isfinite(t.grad).all()), name
    # float64 gradients equal the reference's (exact gradients, SPEC property 8),
    # here at logits of 1e4 where any unguarded exp would overflow
    if dtype == torch.float32:
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ours = torch.autograd.grad(hsa(q64, k64, v64, tree, scale=0.5).sum(), (q64, k64, v64))
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(dense_hsa(PARENT, q64, k64, v64, scale=0.5).sum(),
                                  (q64, k64, v64))
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-7)


# ------------------------------------------------------------- NaN and inf
TREES = ([-1, 0, 0, 1, 1, 2, 2], [-1, 0, 0, 0, 1, 1], [-1, 0, 0])


def forest():
    return Batch.from_data_list([NestedSignal.from_parents(p) for p in TREES])


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_stay_in_their_tree(name, bad):
    """Without check_finite, a NaN / inf in tree 1 leaves the other trees' outputs,
    weights and gradients exactly as they are without it."""
    batch = forest()
    n = batch.num_leaves
    other = batch.structure.leaf_tree != 1
    bad_row = int((~other).nonzero()[1])
    torch.manual_seed(0)
    clean = dict(zip("qkv", torch.randn(3, n, 2, 4).unbind(0)))
    dirty = {key: t.clone() for key, t in clean.items()}
    dirty[name][bad_row, 1, 2] = bad
    outputs = []
    for values in (clean, dirty):
        q, k, v = (values[key].clone().requires_grad_() for key in "qkv")
        y = hsa(q, k, v, batch)
        y[other].sum().backward()
        outputs.append((y.detach(), hsa_weights(values["q"], values["k"], batch),
                        [t.grad for t in (q, k, v)]))
    (y0, w0, g0), (y1, w1, g1) = outputs
    assert bool(torch.isfinite(y1[other]).all())
    assert torch.equal(y1[other], y0[other])
    assert torch.equal(w1[:, other][:, :, other], w0[:, other][:, :, other])
    for a, b in zip(g0, g1):
        assert bool(torch.isfinite(b[other]).all())
        assert torch.equal(a[other], b[other])


def _has_check_finite() -> bool:
    return "check_finite" in inspect.signature(hsa).parameters and \
        "check_finite" in inspect.signature(hsa_weights).parameters


needs_check_finite = pytest.mark.skipif(
    not _has_check_finite(), reason="hsa(..., check_finite=) is not in this checkout yet")


@needs_check_finite
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_names_tensor_and_row(name, bad):
    batch = forest()
    n = batch.num_leaves
    torch.manual_seed(0)
    values = dict(zip("qkv", torch.randn(3, n, 2, 4).unbind(0)))
    values[name][6, 0, 1] = bad
    values[name][8, 1, 0] = bad
    with pytest.raises(ValueError, match=rf"\b{name}\b.*\b6\b"):
        hsa(values["q"], values["k"], values["v"], batch, check_finite=True)
    if name != "v":
        with pytest.raises(ValueError, match=rf"\b{name}\b.*\b6\b"):
            hsa_weights(values["q"], values["k"], batch, check_finite=True)
    else:  # hsa_weights does not read v
        assert bool(torch.isfinite(
            hsa_weights(values["q"], values["k"], batch, check_finite=True)).all())


@needs_check_finite
def test_check_finite_passes_finite_inputs_unchanged():
    tree, q, k, v = inputs(1e4, torch.float32)
    assert torch.equal(hsa(q, k, v, tree, check_finite=True), hsa(q, k, v, tree))
    assert torch.equal(hsa_weights(q, k, tree, check_finite=True), hsa_weights(q, k, tree))


@needs_check_finite
def test_check_finite_names_pos_and_its_node():
    tree, q, k, v = inputs(1.0, torch.float32)
    pos = torch.zeros(tree.num_nodes, 2)
    pos[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"\bpos\b.*\b3\b"):
        hsa(q, k, v, tree, pos=pos, check_finite=True)
    with pytest.raises(ValueError, match=r"\bpos\b.*\b3\b"):
        hsa_weights(q, k, tree, pos=pos, check_finite=True)
