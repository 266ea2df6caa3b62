"""The op front-end (hsa_graph.ops.inputs): a sweep over every public op with inputs of
arbitrary strides, every float dtype and sizes 0, 1 and odd, each compared with the op on
the contiguous float64 copy of the same values, or expected to raise ValueError /
TypeError. Strided inputs once gave silently wrong answers and zero heads killed the
process, so every layout is checked against the dense answer, not only for crashes."""
from __future__ import annotations

import itertools

import pytest
import torch

import hsa_graph
from hsa_graph.ops.cache import HSACache
from hsa_graph.ops.causal import causal_hsa
from hsa_graph.ops.cross import cross_hsa

# a leaf-only family read in place, a mixed family, a lonely leaf and an only child
TREE = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0, 1, 1, 1, 2, 2, 3, 9, 9])
FLAT = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 0, 0])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4,
             torch.float64: 1e-10}


def layouts(t: torch.Tensor):
    """Views with the values of ``t`` (or of a constant along one axis, for expands)
    and other strides: step slices, transposes, expands (stride 0)."""
    yield "contiguous", t
    yield "step", torch.stack([t, torch.full_like(t, 7.0)], -1)[..., 0]
    yield "step-rows", torch.stack([t, torch.full_like(t, 7.0)], 1)[:, 0]
    yield "transposed-last", t.transpose(-1, -2).contiguous().transpose(-1, -2)
    yield "transposed-rows", t.transpose(0, 1).contiguous().transpose(0, 1)
    if t.shape[-1]:
        yield "expand-features", t[..., :1].expand(t.shape)
    if t.shape[1]:
        yield "expand-heads", t[:, :1].expand(t.shape)
    yield "expand-rows", t[:1].expand(t.shape)


def ops():
    n = TREE.num_leaves
    anchor = torch.tensor([0, 1, 4, 9, 10])  # root, internal nodes, a leaf
    return {
        "hsa": lambda q, k, v: hsa_graph.hsa(q, k, v, TREE),
        "hsa-no-self": lambda q, k, v: hsa_graph.hsa(q, k, v, TREE, include_self=False),
        "hsa_weights": lambda q, k, v: hsa_graph.hsa_weights(q, k, TREE),
        "causal_hsa": lambda q, k, v: causal_hsa(q, k, v, TREE),
        "cross_hsa": lambda q, k, v: cross_hsa(q[: anchor.numel()], k, v, TREE, anchor=anchor),
        "cache": lambda q, k, v: _run_cache(q, k, v, n),
    }


def _run_cache(q, k, v, n):
    # the cache grows TREE's leaves one by one (its leaves are contiguous)
    cache = HSACache()
    moves = HSACache.moves_of(TREE)
    return torch.stack([cache.append(q[i], k[i], v[i], **moves[i]) for i in range(n)])


def _inputs(heads, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = TREE.num_leaves
    q, k = (torch.randn(n, heads, d, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _assert_matches(op, q, k, v):
    """``op`` on these views equals ``op`` on their contiguous float64 copies."""
    dtype = q.dtype
    got = op(q, k, v)
    want = op(*(t.contiguous().double() for t in (q, k, v)))
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("name", list(ops()))
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_any_strides_give_the_contiguous_answer(name, which, dtype):
    op = ops()[name]
    inputs = dict(zip("qkv", _inputs(3, 5, 5, dtype, seed=len(name))))
    for layout, view in layouts(inputs[which]):
        args = {**inputs, which: view}
        try:
            _assert_matches(op, args["q"], args["k"], args["v"])
        except AssertionError as error:
            raise AssertionError(f"{name}, {which} {layout}: {error}") from None


@pytest.mark.parametrize("name", list(ops()))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sizes_zero_one_and_odd(name, dtype):
    op = ops()[name]
    for heads, d, dv in itertools.product((0, 1, 3), (0, 1, 5), (0, 1, 4)):
        q, k, v = _inputs(heads, d, dv, dtype)
        try:
            _assert_matches(op, q, k, v)
        except ValueError as error:  # refused with a message that says what is empty
            assert name == "cache" and "at least one" in str(error), (heads, d, dv, error)
        except AssertionError as error:
            raise AssertionError(f"{name}, H={heads} D={d} Dv={dv}: {error}") from None


@pytest.mark.parametrize("name", ["hsa", "hsa_weights", "causal_hsa", "cross_hsa"])
def test_one_head_axis_or_none(name):
    q, k, v = _inputs(1, 4, 4, torch.float64)
    op = ops()[name]
    with_heads = op(q, k, v)
    without = op(q[:, 0], k[:, 0], v[:, 0])
    head_axis = 0 if name == "hsa_weights" else 1
    torch.testing.assert_close(without, with_heads.squeeze(head_axis))
    with pytest.raises(ValueError, match="all have a head axis"):
        op(q[:, 0], k, v)


@pytest.mark.parametrize("name, pair", [
    (name, pair) for name in ("hsa", "hsa_weights", "causal_hsa", "cross_hsa", "cache")
    for pair in (("q", "k"), ("k", "v"), ("q", "v"))
    if not (name == "hsa_weights" and "v" in pair)])     # hsa_weights takes no values
def test_mixed_dtypes_are_refused(name, pair):
    inputs = dict(zip("qkv", _inputs(2, 4, 4, torch.float32)))
    inputs[pair[1]] = inputs[pair[1]].double()
    with pytest.raises(TypeError, match="one dtype"):
        ops()[name](inputs["q"], inputs["k"], inputs["v"])


@pytest.mark.parametrize("bad, error", [
    (torch.ones(12, 2, 4, dtype=torch.int64), TypeError),
    (torch.ones(12, 2, 4, dtype=torch.complex64), TypeError),
    ([[1.0]], TypeError),
    (torch.ones(12, 2, 4, 1), ValueError),
    (torch.ones(3, 2, 4), ValueError),
])
@pytest.mark.parametrize("name", ["hsa", "hsa_weights", "causal_hsa", "cross_hsa"])
def test_bad_tensors_are_refused(name, bad, error):
    q, k, v = _inputs(2, 4, 4, torch.float32)
    with pytest.raises(error):
        ops()[name](q, bad, v)


@pytest.mark.parametrize("scale, error", [("2", TypeError), (True, TypeError),
                                          (float("nan"), ValueError),
                                          (float("inf"), ValueError),
                                          (torch.ones(2), ValueError)])
def test_bad_scales_are_refused(scale, error):
    q, k, v = _inputs(2, 4, 4, torch.float32)
    with pytest.raises(error, match="scale"):
        hsa_graph.hsa(q, k, v, TREE, scale=scale)
    with pytest.raises(error, match="scale"):
        HSACache(scale=scale)


def test_tensor_scale_equals_float_scale():
    q, k, v = _inputs(2, 4, 4, torch.float64)
    torch.testing.assert_close(hsa_graph.hsa(q, k, v, TREE, scale=torch.tensor(0.3)),
                               hsa_graph.hsa(q, k, v, TREE, scale=0.3))


def test_zero_heads_is_an_empty_result_with_gradients():
    # once a SIGFPE that killed the interpreter
    q, k, v = (t.requires_grad_() for t in _inputs(0, 4, 4, torch.float32))
    y = hsa_graph.hsa(q, k, v, TREE)
    assert y.shape == (TREE.num_leaves, 0, 4)
    y.sum().backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape
    assert hsa_graph.hsa_weights(q, k, TREE).shape == (0, TREE.num_leaves, TREE.num_leaves)


def test_zero_features_give_zero_logits():
    # D = 0: every logit is 0, so HSA is the tree's weighting of the values alone
    _, _, v = _inputs(2, 4, 4, torch.float64)
    empty = torch.zeros(TREE.num_leaves, 2, 0, dtype=torch.float64)
    zeros = torch.zeros(TREE.num_leaves, 2, 3, dtype=torch.float64)
    torch.testing.assert_close(hsa_graph.hsa(empty, empty, v, TREE),
                               hsa_graph.hsa(zeros, zeros, v, TREE))


@pytest.mark.parametrize("parent", [[-1], [-1, 0], [-1, 0, 1], [-1, -1]])
@pytest.mark.parametrize("name", ["hsa", "causal_hsa"])
def test_no_weight_at_all_still_backpropagates(parent, name):
    # every leaf alone and include_self=False: the output is zero, yet a function of the
    # inputs (zero gradients), so backward() runs as on any other tree
    tree = hsa_graph.NestedSignal.from_parents(parent)
    n = tree.num_leaves
    q, k, v = (torch.randn(n, 2, 3, requires_grad=True) for _ in range(3))
    op = hsa_graph.hsa if name == "hsa" else causal_hsa
    y = op(q, k, v, tree, include_self=False)
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_no_weight_ignores_non_finite_values():
    tree = hsa_graph.NestedSignal.from_parents([-1])
    q = k = torch.randn(1, 1, 3, requires_grad=True)
    v = torch.full((1, 1, 3), float("nan"), requires_grad=True)
    y = hsa_graph.hsa(q, k, v, tree, include_self=False)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("parent", [[-1, 0, 0, 1, 1, 2, 2, 2, 1],
                                    [-1, 0, 1, 1, 0, 4, 0, 6, 6], [-1, 0, 0, 0]])
@pytest.mark.parametrize("include_self", [True, False])
def test_double_backward(parent, include_self):
    tree = hsa_graph.NestedSignal.from_parents(parent)
    n = tree.num_leaves
    g = torch.Generator().manual_seed(len(parent))
    q, k, v = (torch.randn(n, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    pos = torch.randn(len(parent), 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(
        lambda q, k, v, p: hsa_graph.hsa(q, k, v, tree, include_self=include_self, pos=p),
        (q, k, v, pos))
    assert torch.autograd.gradgradcheck(
        lambda q, k: hsa_graph.hsa_weights(q, k, tree, include_self=include_self), (q, k))
    assert torch.autograd.gradgradcheck(lambda q, k, v: cross_hsa(q[:2], k, v, tree),
                                        (q, k, v))


def test_causal_double_backward_is_refused_with_a_clear_error():
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2, 2])
    q, k, v = (torch.randn(4, 2, 3, requires_grad=True) for _ in range(3))
    y = causal_hsa(q, k, v, tree).sum()
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(y, q, create_graph=True)
    (grad,) = torch.autograd.grad(causal_hsa(q, k, v, tree).sum(), q)  # first order works
    assert torch.isfinite(grad).all()


def test_inputs_on_different_devices_are_refused():
    q, k, v = _inputs(2, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="meta"):
        hsa_graph.hsa(q, k.to("meta"), v, TREE)


def test_flat_tree_of_strided_inputs_is_sdpa():
    # the in-place read of a leaf-only family was the silent wrong answer
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 2, 16, generator=g)
    q, k, v = base[:, :, ::2], base[:, :, 1::2], base.flip(-1)[:, :, ::2]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    torch.testing.assert_close(hsa_graph.hsa(q, k, v, FLAT), sdpa, atol=1e-5, rtol=1e-5)
