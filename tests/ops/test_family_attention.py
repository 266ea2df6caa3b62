"""The family softmax of small families as batched matmuls (``_batched_family_attention``
and its backward; ``_FamilySoftmax`` with its values product deferred to the weighing,
``_WeightedFamilyValues``), against a dense reference written here, and where HSA takes
each."""
import pytest
import torch
from reference import dense_hsa

import hsa_graph
import hsa_graph.ops.hsa as hsa_ops
from hsa_graph.ops.hsa import (
    FamilySoftmax,
    _batched_family_attention,
    _family_attention,
    _family_attention_forward,
    _leaf_family_softmax,
    _small_families,
    _weighted_family_values,
)

F, H, D = 5, 3, 6
NEG_INF = float("-inf")


@pytest.fixture
def threads():
    """Sets the intra-op threads for a test and restores them after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def token_major(b: int, c: int, seed: int, dv: int = D, dtype=torch.float64):
    """``q`` ``[F, H, b, D]``, ``k`` ``[F, H, c, D]``, ``v`` ``[F, H, c, Dv]`` as views of
    token-major rows (the layout HSA hands the kernels), and the upstream gradients of
    the output and the log-sum-exp."""
    gen = torch.Generator().manual_seed(seed)

    def rows(n, d):
        return torch.randn(F, n, H, d, generator=gen, dtype=dtype).transpose(1, 2)

    return (rows(b, D), rows(c, D), rows(c, dv), rows(b, dv),
            torch.randn(F, H, b, generator=gen, dtype=dtype))


def bias_of(kind: str, b: int, c: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(3)
    if kind == "none":
        return None
    if kind == "keys":  # log n(B) per key, the last keys padding (leaf buckets)
        keys = torch.randn(F, 1, 1, c, generator=gen, dtype=dtype)
        keys[..., -2:] = NEG_INF
        return keys
    if kind == "full":  # a masked diagonal (internal members, include_self=False)
        full = torch.randn(F, 1, b, c, generator=gen, dtype=dtype)
        full.diagonal(dim1=-2, dim2=-1).fill_(NEG_INF)
        return full
    if kind == "shared":  # one mask for every family (the extra keys of wide windows)
        shared = torch.zeros(1, 1, b, c, dtype=dtype)
        shared[..., -1] = NEG_INF
        return shared
    assert kind == "matrix"  # a plain [b, c] matrix broadcasts as well
    return torch.randn(b, c, generator=gen, dtype=dtype)


def reference(q, k, v, bias, scale):
    logits = torch.einsum("fhid,fhjd->fhij", q, k) * scale
    if bias is not None:
        logits = logits + bias
    lse = torch.logsumexp(logits, -1)
    return torch.einsum("fhij,fhjd->fhid", torch.softmax(logits, -1), v), lse


SHAPES = [(7, 7), (5, 9), (16, 16), (1, 3)]
KINDS = ["none", "keys", "full", "shared", "matrix"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("b,c", SHAPES)
def test_forward_matches_the_dense_reference(b, c, kind):
    if kind == "full" and b > c:
        pytest.skip("the diagonal mask needs b <= c")
    bias = bias_of(kind, b, c)
    q, k, v, _, _ = token_major(b, c, seed=b + c, dv=4)
    out, lse, p = _batched_family_attention(q, k, v, bias, 0.4)
    ref_out, ref_lse = reference(q, k, v, bias, 0.4)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    assert p.shape == (H, F, b, c)
    torch.testing.assert_close(p.sum(-1), torch.ones(H, F, b, dtype=p.dtype))
    # the output lies token-major, as the fused kernel writes it (the leaf rows are read
    # from it without a copy)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("kind", ["keys", "full"])
@pytest.mark.parametrize("dv", [D, 4])
@pytest.mark.parametrize("b,c", [(7, 7), (5, 9), (16, 16)])
@pytest.mark.parametrize("grads", ["both", "out", "lse"])
def test_backward_matches_autograd_of_the_reference(b, c, dv, kind, grads):
    if kind == "full" and b > c:
        pytest.skip("the diagonal mask needs b <= c")
    bias = bias_of(kind, b, c)
    q, k, v, d_out, d_lse = token_major(b, c, seed=10 * b + c, dv=dv)

    def loss(out, lse):
        return ((out * d_out).sum() if grads != "lse" else 0) + (
            (lse * d_lse).sum() if grads != "out" else 0)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(loss(*reference(*leaves, bias, 0.4)), leaves,
                                   allow_unused=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    assert _small_families(leaves[0], leaves[1], records=True)
    got = torch.autograd.grad(loss(*_family_attention(*leaves, bias, 0.4)), leaves,
                              allow_unused=True)
    for name, g, e, t in zip("qkv", got, expected, (q, k, v)):
        if e is None:  # dv without an output gradient
            assert g is None or g.abs().max() == 0, name
            continue
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11, msg=f"d{name}")
        assert g.stride() == t.stride(), name   # written with the strides of the input


def test_only_the_gradients_asked_for():
    q, k, v, d_out, _ = token_major(6, 6, seed=1)
    q = q.detach().requires_grad_()
    out, lse = _family_attention(q, k, v, None, 0.5)
    (g,) = torch.autograd.grad((out * d_out).sum(), [q])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    (e,) = torch.autograd.grad((reference(*leaves, None, 0.5)[0] * d_out).sum(), leaves[:1])
    torch.testing.assert_close(g, e, rtol=0, atol=1e-11)


def test_family_sums_join_the_gradients():
    q, k, v, d_out, d_lse = token_major(8, 8, seed=2)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse, *sums = _family_attention(*leaves, None, 0.5, True)
    weights = [torch.randn(s.shape, dtype=s.dtype) for s in sums]
    total = (out * d_out).sum() + (lse * d_lse).sum() + sum(
        (s * w).sum() for s, w in zip(sums, weights))
    got = torch.autograd.grad(total, leaves)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, None, 0.5)
    total = (ref_out * d_out).sum() + (ref_lse * d_lse).sum() + sum(
        (t.sum(2) * w).sum() for t, w in zip(leaves, weights))
    for g, e in zip(got, torch.autograd.grad(total, leaves)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11)


def test_a_row_without_keys_gets_zero_output_and_minus_infinite_lse():
    q, k, v, d_out, d_lse = token_major(4, 4, seed=4)
    bias = torch.zeros(F, 1, 4, 4, dtype=q.dtype)
    bias[2, :, 1] = NEG_INF                      # family 2, row 1: every key masked
    out, lse, p = _batched_family_attention(q, k, v, bias, 0.5)
    assert out[2, :, 1].abs().max() == 0 and (lse[2, :, 1] == NEG_INF).all()
    assert p[:, 2, 1].abs().max() == 0
    keep = torch.ones(F, dtype=torch.bool)
    keep[2] = False
    ref_out, ref_lse = reference(q[keep], k[keep], v[keep], bias[keep], 0.5)
    torch.testing.assert_close(out[keep], ref_out, rtol=0, atol=1e-12)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = _family_attention(*leaves, bias, 0.5)
    finite = torch.where(lse.isfinite(), lse, 0.0)
    grads = torch.autograd.grad((out * d_out).sum() + (finite * d_lse).sum(), leaves)
    assert all(g.isfinite().all() for g in grads)


def test_where_small_families_run_as_batched_matmuls(threads, monkeypatch):
    q = torch.randn(F, H, 16, D)
    wide = torch.randn(F, H, 17, D)
    threads(1)
    assert _small_families(q, q, records=True)       # the fused backward costs more
    assert not _small_families(q, q, records=False)  # 1 thread: the fused forward is faster
    threads(2)
    many = torch.randn(hsa_ops._MIN_BATCHED_FAMILIES, H, 16, D)
    assert _small_families(many, many, records=False)   # the fused forward does not scale
    assert not _small_families(q, q, records=False)     # few families: one fused call
    assert _small_families(q, q, records=True)
    assert not _small_families(wide, wide, records=True)   # 17 queries
    assert not _small_families(q, wide, records=True)      # 17 keys
    monkeypatch.setattr(hsa_ops, "_SMALL_BUCKET_BYTES", q.numel() * q.element_size() - 1)
    assert not _small_families(q, q, records=True)   # a bucket too large for the heap


@pytest.mark.parametrize("records", [False, True])
def test_both_kernels_agree_inside_the_autograd_function(records, monkeypatch):
    q, k, v, d_out, d_lse = token_major(9, 9, seed=6)
    bias = bias_of("full", 9, 9)
    results = []
    for batched in (False, True):
        monkeypatch.setattr(hsa_ops, "_small_families", lambda *args, on=batched: on)
        leaves = [t.detach().requires_grad_(records) for t in (q, k, v)]
        out, lse = hsa_ops._FamilyAttention.apply(*leaves, bias, 0.3, False, records)
        if not records:
            results.append((out, lse))
            continue
        results.append(torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), leaves))
    for fused, batched in zip(*results):
        torch.testing.assert_close(fused, batched, rtol=0, atol=1e-11)
    if not records:
        torch.testing.assert_close(results[0][0],
                                   _family_attention_forward(q, k, v, bias, 0.3)[0])


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("include_self", [True, False])
def test_hsa_on_small_trees_at_one_and_two_threads(num_threads, include_self, threads):
    """The whole operator, forward and gradients, on a batch of trees with families of
    16 leaves and of 4 subtrees, whichever kernel the thread count picks."""
    threads(num_threads)
    parent = [-1] + [0] * 4 + [1 + i // 16 for i in range(64)]
    tree = hsa_graph.NestedSignal.from_parents(parent)
    gen = torch.Generator().manual_seed(num_threads)
    q, k, v = (torch.randn(64, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        y = hsa_graph.hsa(q, k, v, tree, include_self=include_self)
    expected = dense_hsa(torch.tensor(parent), q, k, v, include_self=include_self)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    weights = torch.randn(64, 2, 8, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((hsa_graph.hsa(*leaves, tree, include_self=include_self)
                               * weights).sum(), leaves)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad((dense_hsa(torch.tensor(parent), *ref,
                                          include_self=include_self) * weights).sum(), ref)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11)


def weighed_reference(q, k, v, bias, scale, above, w):
    """``above + w * softmax(s q k^T + bias) v`` per family, token-major ``[F, b, H, Dv]``,
    and the log-sum-exp."""
    out, lse = reference(q, k, v, bias, scale)
    return (above.unsqueeze(2) + w[..., None, None] * out).transpose(1, 2), lse


def weighing_operands(b: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    above = torch.randn(F, H, 4, generator=gen, dtype=dtype)
    w = torch.rand(F, H, generator=gen, dtype=dtype)
    d_y = torch.randn(F, b, H, 4, generator=gen, dtype=dtype)
    return above, w, d_y


@pytest.mark.parametrize("kind", ["none", "keys", "full"])
@pytest.mark.parametrize("b", [5, 16])
@pytest.mark.parametrize("family_sums", [False, True])
def test_deferred_values_match_the_dense_reference(b, kind, family_sums):
    """``_FamilySoftmax`` then ``_WeightedFamilyValues`` (P handed from one node to the
    other, P v formed only in the weighing): forward, and every gradient (``q, k, v``,
    ``above``, ``w``) from the output's, the log-sum-exp's and the family sums'."""
    bias = bias_of(kind, b, b)
    q, k, v, _, d_lse = token_major(b, b, seed=10 + b, dv=4)
    above, w, d_y = weighing_operands(b, seed=b)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, above, w)]
    family, lse, *sums = _leaf_family_softmax(*leaves[:3], bias, 0.4, family_sums)
    assert isinstance(family, FamilySoftmax) and family.p.shape == (H, F, b, b)
    y = _weighted_family_values(leaves[3], leaves[4], family)
    assert y.shape == (F, b, H, 4) and y.is_contiguous()
    ref_leaves = [t.detach().requires_grad_() for t in (q, k, v, above, w)]
    ref_y, ref_lse = weighed_reference(*ref_leaves[:3], bias, 0.4, *ref_leaves[3:])
    torch.testing.assert_close(y, ref_y, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    d_sums = [torch.randn(F, H, t.shape[-1], dtype=q.dtype) for t in (q, k, v)]
    total = (y * d_y).sum() + (lse * d_lse).sum() + sum(
        (s * d).sum() for s, d in zip(sums, d_sums))
    ref_total = (ref_y * d_y).sum() + (ref_lse * d_lse).sum()
    if family_sums:
        ref_total = ref_total + sum((t.sum(2) * d).sum()
                                    for t, d in zip(ref_leaves[:3], d_sums))
    got = torch.autograd.grad(total, leaves)
    for name, g, e in zip("q k v above w".split(), got,
                          torch.autograd.grad(ref_total, ref_leaves)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11, msg=name)
    assert all(g.stride() == t.stride() for g, t in zip(got[:3], leaves[:3]))


def test_deferred_values_give_only_the_gradients_asked_for():
    q, k, v, _, _ = token_major(6, 6, seed=3, dv=4)
    above, w, d_y = weighing_operands(6, seed=3)
    for asked in range(5):
        leaves = [t.detach().requires_grad_(i == asked)
                  for i, t in enumerate((q, k, v, above, w))]
        family, _ = _leaf_family_softmax(*leaves[:3], None, 0.5)
        (g,) = torch.autograd.grad((_weighted_family_values(leaves[3], leaves[4], family)
                                    * d_y).sum(), leaves[asked])
        ref_leaves = [t.detach().requires_grad_() for t in (q, k, v, above, w)]
        (e,) = torch.autograd.grad((weighed_reference(*ref_leaves[:3], None, 0.5,
                                                      *ref_leaves[3:])[0] * d_y).sum(),
                                   ref_leaves[asked])
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11)


def test_deferred_values_twice_differentiable():
    """create_graph: both nodes' backwards in differentiable ops (gradgradcheck)."""
    q, k, v, _, _ = token_major(4, 4, seed=5, dv=4)
    above, w, _ = weighing_operands(4, seed=5)
    bias = bias_of("full", 4, 4)

    def fn(q, k, v, above, w):
        family, lse, *sums = _leaf_family_softmax(q, k, v, bias, 0.7, True)
        return _weighted_family_values(above, w, family), lse, *sums

    inputs = [t.detach().requires_grad_() for t in (q, k, v, above, w)]
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_deferred_values_with_a_row_without_keys():
    """A query whose every key is masked: P = 0 there, so its row is ``above`` alone and
    every gradient is finite."""
    q, k, v, _, _ = token_major(4, 4, seed=4, dv=4)
    above, w, d_y = weighing_operands(4, seed=4)
    bias = torch.zeros(F, 1, 4, 4, dtype=q.dtype)
    bias[2, :, 1] = NEG_INF
    leaves = [t.detach().requires_grad_() for t in (q, k, v, above, w)]
    family, lse = _leaf_family_softmax(*leaves[:3], bias, 0.5)
    y = _weighted_family_values(leaves[3], leaves[4], family)
    torch.testing.assert_close(y[2, 1], above[2], rtol=0, atol=0)
    assert (lse[2, :, 1] == NEG_INF).all()
    finite = torch.where(lse.isfinite(), lse, 0.0)
    grads = torch.autograd.grad((y * d_y).sum() + finite.sum(), leaves)
    assert all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("records", [False, True])
def test_where_hsa_defers_the_values_product(num_threads, records, threads, monkeypatch):
    """hsa keeps a bucket of leaves alone as probabilities where its small families run
    as batched matmuls (autograd records, or 2+ threads over enough families), not where
    the fused forward runs (1 thread without autograd, or a few families), not with
    positions (their features widen the values) and not for families of 17; the output
    equals the dense reference whichever path runs."""
    threads(num_threads)
    deferred = []
    real = hsa_ops._leaf_family_softmax

    def spy(*args, **kwargs):
        deferred.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(hsa_ops, "_leaf_family_softmax", spy)
    gen = torch.Generator().manual_seed(8)
    many = hsa_ops._MIN_BATCHED_FAMILIES
    for size, families, with_pos, expect in [(16, many, False, records or num_threads > 1),
                                             (16, 3, False, records),
                                             (16, many, True, False), (17, 3, False, False)]:
        parent = [-1] + [0] * families + [1 + i // size for i in range(families * size)]
        tree = hsa_graph.NestedSignal.from_parents(parent)
        n = families * size
        q, k, v = (torch.randn(n, 2, 4, generator=gen, dtype=torch.float64)
                   for _ in range(3))
        pos = torch.randn(len(parent), 3, generator=gen, dtype=torch.float64) \
            if with_pos else None
        deferred.clear()
        leaves = [t.clone().requires_grad_(records) for t in (q, k, v)]
        with torch.set_grad_enabled(records):
            y = hsa_graph.hsa(*leaves, tree, pos=pos)
        assert bool(deferred) == expect, (size, families, with_pos)
        expected = dense_hsa(torch.tensor(parent), q, k, v, pos=pos)
        torch.testing.assert_close(y.detach(), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("grads", ["both", "out", "lse"])
def test_matmul_fallback_of_the_fused_backward(grads, monkeypatch):
    """Where the fused CPU backward does not apply (other devices, half precision), the
    fused kernel's forward is followed by the per-head matmul backward, in place into
    gradients with the inputs' strides: against autograd of the reference."""
    monkeypatch.setattr(hsa_ops, "_small_families", lambda *args: False)
    monkeypatch.setattr(hsa_ops, "cpu_flash_attention_backward", lambda *args: None)
    q, k, v, d_out, d_lse = token_major(9, 9, seed=7, dv=4)
    bias = bias_of("full", 9, 9)
    d_out = d_out if grads != "lse" else torch.zeros_like(d_out)
    d_lse = d_lse if grads != "out" else torch.zeros_like(d_lse)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = _family_attention(*leaves, bias, 0.3)
    got = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), leaves)
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*ref, bias, 0.3)
    want = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), ref)
    for g, e, t in zip(got, want, leaves):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-11)
        assert g.stride() == t.stride()
