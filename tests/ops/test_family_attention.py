"""The family softmax of small families as batched matmuls (``_batched_family_attention``
and its backward), against a dense reference written here, and where HSA takes it."""
import pytest
import torch
from reference import dense_hsa

import hsa_graph
import hsa_graph.ops.hsa as hsa_ops
from hsa_graph.ops.hsa import (
    _batched_family_attention,
    _family_attention,
    _family_attention_forward,
    _small_families,
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
    assert _small_families(q, q, records=False)      # the fused forward does not scale
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
