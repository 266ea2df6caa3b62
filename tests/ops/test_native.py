"""The compiled CPU kernel of the softmax inside small families of consecutive leaves
(``hsa_graph.ops.native``): against a float64 reference written here, on strided
inputs, at the edges of its contract, where it does not apply, through ``hsa``, and its
build (cached, and a failed build warned about and replaced by PyTorch's kernels)."""
import warnings

import pytest
import torch
from reference import dense_hsa
from torch_geometric.data import Batch

import hsa_graph
import hsa_graph.typing as hsa_typing
from hsa_graph.ops import native
from hsa_graph.ops.native import native_family_attention, native_kernel_available

pytestmark = pytest.mark.skipif(not native_kernel_available(),
                                reason="no C compiler here (PyTorch's kernels run instead)")


def reference(q, k, v, size, include_self, scale):
    """Families of ``size`` consecutive rows in float64, written out: logits, masked
    diagonal, log-sum-exp, probabilities (a row without keys: lse -inf, output 0)."""
    n, h, d = q.shape
    f = n // size
    qf, kf, vf = (t.double().reshape(f, size, h, -1).transpose(1, 2) for t in (q, k, v))
    logits = scale * qf @ kf.transpose(-1, -2)                      # [F, H, b, b]
    if not include_self:
        logits = logits.masked_fill(torch.eye(size, dtype=torch.bool), float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = (p @ vf).transpose(1, 2).reshape(n, h, -1)
    sums = [t.sum(2) for t in (qf, kf, vf)]                         # [F, H, *]
    return out, lse, sums


def inputs(n, h, d, dv, seed, scale_up=1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (scale_up * torch.randn(n, h, d, generator=gen) for _ in range(2))
    return q, k, torch.randn(n, h, dv, generator=gen)


def with_and_without_kernel(monkeypatch, q, k, v, tree, include_self=True):
    """``hsa`` without autograd through the kernel, checked equal to the same call
    through PyTorch's kernels (the compiler hidden), and returned."""
    with torch.no_grad():
        fast = hsa_graph.hsa(q, k, v, tree, include_self=include_self)
        monkeypatch.setattr(hsa_typing, "WITH_C_COMPILER", False)
        slow = hsa_graph.hsa(q, k, v, tree, include_self=include_self)
        monkeypatch.setattr(hsa_typing, "WITH_C_COMPILER", True)
    torch.testing.assert_close(fast, slow, atol=2e-5, rtol=1e-5)
    return fast


def count_kernel_calls(monkeypatch, name):
    """Wrap ``hsa_graph.ops.hsa``'s handle on the kernel function ``name``: the list
    returned gets, per call, the rows of its first argument where the kernel ran, else
    ``None``."""
    import hsa_graph.ops.hsa as hsa_ops

    calls = []
    function = getattr(native, name)

    def counted(first, *args, **kwargs):
        result = function(first, *args, **kwargs)
        calls.append(None if result is None else first.shape[0])
        return result

    monkeypatch.setattr(hsa_ops, name, counted)
    return calls


def check_dense(y, parents, q, k, v, include_self=True):
    want = dense_hsa(parents, q.double(), k.double(), v.double(), include_self=include_self)
    torch.testing.assert_close(y.double(), want, atol=2e-5, rtol=1e-5)


def check(q, k, v, size, include_self, scale=0.125, atol=2e-5):
    with torch.no_grad():
        result = native_family_attention(q, k, v, size, include_self, scale)
    assert result is not None
    out, lse, *sums = result
    f, h = q.shape[0] // size, q.shape[1]
    assert out.shape == (f, h, size, v.shape[-1]) and lse.shape == (f, h, size)
    want_out, want_lse, want_sums = reference(q, k, v, size, include_self, scale)
    got_out = out.transpose(1, 2).reshape(q.shape[0], h, -1)
    torch.testing.assert_close(got_out.double(), want_out, atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=atol, rtol=1e-5)
    for got, want in zip(sums, want_sums):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    return result


@pytest.mark.parametrize("size", [1, 2, 3, 7, 15, 16])
@pytest.mark.parametrize("include_self", [True, False])
def test_matches_reference_every_family_size(size, include_self):
    q, k, v = inputs(size * 5, 3, 32, 48, seed=size)
    out, lse, *_ = check(q, k, v, size, include_self)
    if size == 1 and not include_self:  # no keys at all: lse -inf, output 0
        assert torch.isneginf(lse).all() and (out == 0).all()


@pytest.mark.parametrize("d,dv,heads", [(16, 16, 1), (64, 64, 4), (128, 32, 2),
                                        (1024, 16, 1), (16, 256, 3)])
def test_matches_reference_feature_widths(d, dv, heads):
    q, k, v = inputs(16 * 9, heads, d, dv, seed=d + dv)
    check(q, k, v, 16, True, scale=d ** -0.5)


def test_strided_rows_and_heads():
    """Rows of one fused projection ``[N, 3, H, D]`` and head-major storage are read in
    place, as they lie."""
    n, h, d = 16 * 6, 4, 32
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, 3, h, d, generator=gen)
    check(qkv[:, 0], qkv[:, 1], qkv[:, 2], 16, True)
    q, k, v = (torch.randn(h, n, d, generator=gen).transpose(0, 1) for _ in range(3))
    assert q.stride() == (d, n * d, 1)
    check(q, k, v, 8, False)


def test_extreme_logits_stay_finite():
    """Logits of magnitude ~1e4 (float32): the softmax subtracts each row's maximum."""
    q, k, v = inputs(16 * 4, 2, 64, 64, seed=5, scale_up=40.0)
    out, lse, *_ = check(q, k, v, 16, True, scale=1.0, atol=5e-3)
    assert torch.isfinite(out).all() and lse.abs().max() > 1e3


def test_nan_spreads_to_its_rows_only():
    """A NaN query spoils its own row; a NaN key its family's rows; nothing else."""
    q, k, v = inputs(16 * 3, 2, 16, 16, seed=6)
    q[5, 1, 3] = float("nan")
    k[40, 0, 0] = float("nan")
    with torch.no_grad():
        out, lse, *_ = native_family_attention(q, k, v, 16, True, 0.25)
    rows = out.transpose(1, 2).reshape(48, 2, 16)
    assert torch.isnan(rows[5, 1]).all() and torch.isnan(lse[0, 1, 5])
    assert torch.isnan(rows[32:, 0]).all() and torch.isnan(lse[2, 0]).all()
    bad = torch.zeros(48, 2, dtype=torch.bool)
    bad[5, 1] = True
    bad[32:, 0] = True
    assert torch.isfinite(rows[~bad]).all()


def test_threads_give_identical_results():
    q, k, v = inputs(16 * 33, 4, 64, 64, seed=7)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            with torch.no_grad():
                results.append(native_family_attention(q, k, v, 16, True, 0.125))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_does_not_apply():
    q, k, v = inputs(32, 2, 16, 16, seed=8)
    assert native_family_attention(q.double(), k.double(), v.double(), 16, True, 1.0) is None
    big = inputs(65 * 2, 2, 16, 16, seed=8)
    assert native_family_attention(*big, 65, True, 1.0) is None            # b > 64
    assert native_family_attention(q, k, v, 5, True, 1.0) is None            # 32 % 5
    narrow = inputs(32, 2, 24, 16, seed=8)
    assert native_family_attention(*narrow, 16, True, 1.0) is None          # D % 16
    wide = torch.randn(32, 2, 32)[..., ::2]
    assert native_family_attention(wide, wide, v, 16, True, 1.0) is None    # feature stride
    leaf = q.clone().requires_grad_()
    assert native_family_attention(leaf, k, v, 16, True, 1.0) is None       # autograd
    with torch.no_grad():
        assert native_family_attention(leaf, k, v, 16, True, 1.0) is not None


def test_hsa_with_and_without_the_kernel(monkeypatch):
    """Balanced trees (the kernel takes the leaf families and hands the means their sums)
    and flat trees of 16 leaves: equal to the dense reference and to PyTorch's kernels."""
    def balanced(n):
        return [-1] + [0] * (n // 16) + [1 + i // 16 for i in range(n)]

    for leaves, dv, include_self in ((64, 64, True), (64, 32, False), (16, 64, False),
                                     (256, 16, True)):
        parents = [balanced(leaves) if leaves > 16 else [-1] + [0] * 16] * 3
        tree = Batch.from_data_list([hsa_graph.NestedSignal.from_parents(p)
                                     for p in parents])
        q, k, v = inputs(3 * leaves, 2, 32, dv, seed=leaves + dv)
        fast = with_and_without_kernel(monkeypatch, q, k, v, tree, include_self)
        for t in range(3):
            rows = slice(t * leaves, (t + 1) * leaves)
            check_dense(fast[rows], parents[t], q[rows], k[rows], v[rows], include_self)


def test_build_is_cached_and_failure_falls_back(monkeypatch, tmp_path):
    """A second process finds the library built (no compiler run); a compiler that
    fails gives a warning and ``None``, and ``hsa`` then runs PyTorch's kernels."""
    compiler = hsa_typing.C_COMPILER
    first, _ = native._build(compiler)
    assert first is not None and first.exists()

    def no_compiler(*args, **kwargs):
        raise AssertionError("the cached library should have been found")

    monkeypatch.setattr(native.subprocess, "run", no_compiler)
    assert native._build(compiler)[0] == first
    monkeypatch.undo()

    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: no such luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(hsa_typing, "C_COMPILER", str(broken))
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_tried", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native._load() is None
    assert any("no such luck" in str(w.message) for w in caught)
    q, k, v = inputs(64, 2, 16, 16, seed=9)
    parents = [-1] + [0] * 4 + [1 + i // 16 for i in range(64)]
    with torch.no_grad():
        assert native_family_attention(q, k, v, 16, True, 0.25) is None
        y = hsa_graph.hsa(q, k, v, hsa_graph.NestedSignal.from_parents(parents))
    torch.testing.assert_close(y.double(), dense_hsa(parents, q.double(), k.double(),
                                                     v.double()), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [3, 16, 32, 64])
@pytest.mark.parametrize("include_self", [True, False])
def test_gathered_families_with_padding(size, include_self):
    """Members read by index, the last slots of some families padding (key bias
    ``-inf``: never attended to, their outputs never written), outputs written by index
    into a buffer with a spare row."""
    n, h, d, dv, f = 200, 2, 32, 16, 9
    gen = torch.Generator().manual_seed(size)
    q, k, v = inputs(n, h, d, dv, seed=size)
    rows_in = torch.randint(0, n, (f, size), generator=gen)
    members = torch.randint(1, size + 1, (f,), generator=gen)
    padding = torch.arange(size) >= members[:, None]                       # [F, b]
    key_bias = torch.zeros(f, size).masked_fill(padding, float("-inf"))
    rows_out = torch.arange(f * size).view(f, size).masked_fill(padding, f * size)
    out = torch.full((f * size + 1, h, dv), 7.0)
    with torch.no_grad():
        result = native.native_gathered_family_attention(q, k, v, rows_in, key_bias,
                                                         include_self, 0.2, out, rows_out)
        in_slot_order = native.native_gathered_family_attention(q, k, v, rows_in, key_bias,
                                                                include_self, 0.2)
    assert result is not None and result[0] is out
    lse = result[1]
    slots = rows_in.reshape(-1)
    logits = 0.2 * torch.einsum("fihd,fjhd->fhij", q[slots].view(f, size, h, d).double(),
                                k[slots].view(f, size, h, d).double())
    logits = logits + key_bias.double()[:, None, None, :]
    if not include_self:
        logits = logits.masked_fill(torch.eye(size, dtype=torch.bool), float("-inf"))
    want_lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - want_lse.unsqueeze(-1)).nan_to_num(0.0)
    want = torch.einsum("fhij,fjhd->fihd", p, v[slots].view(f, size, h, dv).double())
    real = ~padding
    torch.testing.assert_close(out[:-1].view(f, size, h, dv)[real].double(), want[real],
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.transpose(1, 2)[real].double(),
                               want_lse.transpose(1, 2)[real], atol=2e-5, rtol=1e-5)
    assert (out[:-1].view(f, size, h, dv)[padding] == 7.0).all()   # padding rows untouched
    assert (out[-1] == 7.0).all()
    fresh, fresh_lse = in_slot_order                           # a new buffer, slot order
    assert fresh.shape == (f * size, h, dv)
    torch.testing.assert_close(fresh.view(f, size, h, dv)[real], out[:-1].view(
        f, size, h, dv)[real], atol=0, rtol=0)
    torch.testing.assert_close(fresh_lse.transpose(1, 2)[real], lse.transpose(1, 2)[real],
                               atol=0, rtol=0)


def test_ragged_trees_take_the_gathered_kernel(monkeypatch):
    """Families of 2..30 leaves in buckets read by index: through ``hsa`` the kernel
    runs (counted), and the result equals the dense reference and PyTorch's kernels."""
    calls = count_kernel_calls(monkeypatch, "native_gathered_family_attention")
    gen = torch.Generator().manual_seed(11)
    sizes = torch.randint(2, 31, (12,), generator=gen).tolist()
    parents = [-1] + [0] * len(sizes)
    for family, count in enumerate(sizes):
        parents += [1 + family] * count
    n = sum(sizes)
    q, k, v = inputs(n, 2, 32, 32, seed=12)
    tree = hsa_graph.NestedSignal.from_parents(parents)
    for include_self in (True, False):
        fast = with_and_without_kernel(monkeypatch, q, k, v, tree, include_self)
        check_dense(fast, parents, q, k, v, include_self)
    assert any(rows is not None for rows in calls)


def test_internal_families_take_the_gathered_kernel(monkeypatch):
    """A balanced tree of branching 16 over 4,096 leaves, and a ragged one: the buckets
    of internal members (read as a range, or by index) run through the kernel without
    autograd, and ``hsa`` equals the dense reference and PyTorch's kernels."""
    kinds = count_kernel_calls(monkeypatch, "native_gathered_family_attention")
    gen = torch.Generator().manual_seed(5)
    balanced = [-1] + [0] * 16 + [1 + i // 16 for i in range(256)]
    balanced += [17 + i // 16 for i in range(4096)]
    ragged = [-1]
    for _ in range(5):   # 5 subtrees of 2..20 families of 2..20 leaves
        top = len(ragged)
        ragged.append(0)
        for _ in range(int(torch.randint(2, 21, (1,), generator=gen))):
            mid = len(ragged)
            ragged.append(top)
            ragged += [mid] * int(torch.randint(2, 21, (1,), generator=gen))
    for parents in (balanced, ragged):
        kinds.clear()
        tree = hsa_graph.NestedSignal.from_parents(parents)
        n = len(parents) - len(set(parents) - {-1})
        q, k, v = inputs(n, 2, 16, 16, seed=len(parents))
        for include_self in (True, False):
            fast = with_and_without_kernel(monkeypatch, q, k, v, tree, include_self)
            check_dense(fast, parents, q, k, v, include_self)
        assert any(rows is not None and rows < n for rows in kinds), \
            "no bucket of internal members ran natively"


@pytest.mark.parametrize("gathered", [False, True])
def test_sums_into_given_rows(gathered):
    """The families' sums written into rows of given tensors (``sum_rows``), padding
    slots not summed, every other row untouched; misuse is a ValueError."""
    n, h, d, dv, size = 96, 2, 16, 32, 8
    f = n // size
    q, k, v = inputs(n, h, d, dv, seed=21)
    sum_rows = torch.randperm(f + 5, generator=torch.Generator().manual_seed(3))[:f]
    into = (torch.full((f + 5, h, d), 7.0), torch.full((f + 5, h, d), 7.0),
            torch.full((f + 5, h, dv), 7.0))
    rows_in = torch.arange(n).flip(0).view(f, size)
    padding = torch.zeros(f, size, dtype=torch.bool)
    padding[::3, -2:] = True
    with torch.no_grad():
        if gathered:
            key_bias = torch.zeros(f, size).masked_fill(padding, float("-inf"))
            result = native.native_gathered_family_attention(
                q, k, v, rows_in, key_bias, True, 0.25, sums_into=into, sum_rows=sum_rows)
            members = rows_in
        else:
            padding[:] = False
            result = native_family_attention(q, k, v, size, True, 0.25, sums_into=into,
                                             sum_rows=sum_rows)
            members = torch.arange(n).view(f, size)
    assert result is not None
    real = (~padding).double()[..., None, None]
    for got, t in zip(into, (q, k, v)):
        want = (t.double()[members] * real).sum(1)                    # [F, H, *]
        torch.testing.assert_close(got[sum_rows].double(), want, atol=1e-5, rtol=1e-6)
        untouched = torch.ones(f + 5, dtype=torch.bool)
        untouched[sum_rows] = False
        assert (got[untouched] == 7.0).all()
    if not gathered:
        assert all(a is b for a, b in zip(result[2:], into))
    with torch.no_grad(), pytest.raises(ValueError, match="sums_into"):
        native_family_attention(q, k, v, size, True, 0.25, sums_into=into[:2])
    with torch.no_grad(), pytest.raises(ValueError, match="sums_into"):
        native_family_attention(q, k, v, size, True, 0.25,
                                sums_into=(into[0], into[1], into[1]))
    with torch.no_grad(), pytest.raises(ValueError, match="sum_rows"):
        native_family_attention(q, k, v, size, True, 0.25, sums_into=into,
                                sum_rows=sum_rows.int())
    with torch.no_grad(), pytest.raises(ValueError, match="without sums_into"):
        native_family_attention(q, k, v, size, True, 0.25, sum_rows=sum_rows)


def test_ragged_means_read_no_leaf_again(monkeypatch):
    """Ragged families of leaves alone, below internal families: the kernel writes the
    families' sums into the means' buffer, the leaves' rows are not summed again
    (``to_internal`` sees no ``[N, H, D]`` rows), and the result is the dense
    reference."""
    from hsa_graph.structure import TreeStructure

    to_internal = TreeStructure.to_internal

    def no_leaf_sums(self, leaf_values, *args, **kwargs):   # (per-leaf scalars may pass)
        if leaf_values.dim() == 3:
            raise AssertionError("to_internal ran on q, k or v: the leaves were summed "
                                 "again")
        return to_internal(self, leaf_values, *args, **kwargs)

    gen = torch.Generator().manual_seed(8)
    parents = [-1]
    for _ in range(4):
        top = len(parents)
        parents.append(0)
        for _ in range(int(torch.randint(2, 6, (1,), generator=gen))):
            mid = len(parents)
            parents.append(top)
            parents += [mid] * int(torch.randint(2, 40, (1,), generator=gen))
    tree = hsa_graph.NestedSignal.from_parents(parents)
    assert tree.structure.leaf_family_buckets is not None
    n = tree.structure.num_leaves
    q, k, v = inputs(n, 2, 32, 32, seed=9)
    monkeypatch.setattr(TreeStructure, "to_internal", no_leaf_sums)
    with torch.no_grad():
        check_dense(hsa_graph.hsa(q, k, v, tree), parents, q, k, v)


@pytest.mark.parametrize("size", [1, 3, 16, 24, 64])
@pytest.mark.parametrize("include_self", [True, False])
def test_backward_matches_autograd_of_the_reference(size, include_self):
    """The kernel's backward (P recomputed from q, k and the log-sum-exp) against
    autograd through the float64 reference, for random gradients of the output, the
    log-sum-exp and the families' sums, on strided rows (q, k, v views of one
    projection, the output's gradient a transposed view)."""
    if size == 1 and not include_self:   # no key at all: the reference's gradient is NaN
        pytest.skip("a row without keys")
    n, h, d, dv = 5 * size, 2, 32, 16
    gen = torch.Generator().manual_seed(size)
    qkv = torch.randn(n, 2 * h * d + h * dv, generator=gen)
    q = qkv[:, :h * d].view(n, h, d)
    k = qkv[:, h * d:2 * h * d].view(n, h, d)
    v = qkv[:, 2 * h * d:].view(n, h, dv)
    f = n // size
    d_out = torch.randn(h, n, dv, generator=gen).transpose(0, 1)
    d_lse = torch.randn(f, h, size, generator=gen)
    d_sums = (torch.randn(f, h, d, generator=gen), torch.randn(f, h, d, generator=gen),
              torch.randn(f, h, dv, generator=gen))
    with torch.no_grad():
        out, lse, *_ = native_family_attention(q, k, v, size, include_self, 0.3)
        out = out.transpose(1, 2).reshape(n, h, dv)
        grads = native.native_family_attention_backward(
            q, k, v, out, lse, d_out, d_lse, d_sums, size, include_self, 0.3)
    assert grads is not None
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, want_lse, want_sums = reference(*leaves, size, include_self, 0.3)
    loss = ((want_out * d_out.double()).sum() + (want_lse * d_lse.double()).sum()
            + sum((s * g.double()).sum() for s, g in zip(want_sums, d_sums)))
    want = torch.autograd.grad(loss, leaves)
    for got, expected in zip(grads, want):
        assert got.is_contiguous()
        torch.testing.assert_close(got.double(), expected, atol=5e-5, rtol=1e-4)


def test_backward_without_lse_gradient_and_dead_rows():
    """``d_lse`` and the sums' gradients may be absent; a row with no key (a family of
    one without include_self) has ``P = 0``: its query gets no gradient, its key and
    value only their sums'."""
    q, k, v = inputs(32, 2, 16, 16, seed=4)
    with torch.no_grad():
        out, lse, *_ = native_family_attention(q, k, v, 1, False, 0.5)
        d_out = torch.randn(32, 2, 16)
        g_v = torch.randn(32, 2, 16)
        dq, dk, dv = native.native_family_attention_backward(
            q, k, v, out.transpose(1, 2).reshape(32, 2, 16), lse, d_out, None,
            (None, None, g_v), 1, False, 0.5)
    assert (dq == 0).all() and (dk == 0).all()
    torch.testing.assert_close(dv, g_v)


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dv", [32, 16])
def test_hsa_gradients_through_the_kernel(monkeypatch, include_self, dv):
    """Where autograd records, the bucket of every leaf (balanced trees under a root)
    runs the kernel forward and backward (counted): output and gradients of q, k, v
    equal PyTorch's kernels and the float64 dense reference; a second-order gradient
    (create_graph) still goes through differentiable ops."""
    calls = count_kernel_calls(monkeypatch, "native_family_attention_backward")
    parents = [-1] + [0] * 4 + [1 + i // 16 for i in range(64)]
    tree = Batch.from_data_list([hsa_graph.NestedSignal.from_parents(parents)] * 2)
    q0, k0, v0 = inputs(128, 2, 32, dv, seed=dv)
    weights = torch.randn(128, 2, dv, generator=torch.Generator().manual_seed(1))

    def run(compiler):
        monkeypatch.setattr(hsa_typing, "WITH_C_COMPILER", compiler)
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        y = hsa_graph.hsa(q, k, v, tree, include_self=include_self)
        (y * weights).sum().backward()
        return y.detach(), q.grad, k.grad, v.grad

    fast = run(True)
    assert calls and all(rows is not None for rows in calls)
    slow = run(False)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    leaves = [t.double().requires_grad_() for t in (q0, k0, v0)]
    want = torch.cat([dense_hsa(parents, *(t[i * 64:(i + 1) * 64] for t in leaves),
                                include_self=include_self) for i in range(2)])
    want_grads = torch.autograd.grad((want * weights.double()).sum(), leaves)
    torch.testing.assert_close(fast[0].double(), want.detach(), atol=2e-5, rtol=1e-5)
    for got, expected in zip(fast[1:], want_grads):
        torch.testing.assert_close(got.double(), expected, atol=5e-5, rtol=1e-4)
    second = []
    for compiler in (True, False):
        monkeypatch.setattr(hsa_typing, "WITH_C_COMPILER", compiler)
        q = q0.clone().requires_grad_()
        y = hsa_graph.hsa(q, k0, v0, tree, include_self=include_self)
        (g,) = torch.autograd.grad((y * weights).sum(), q, create_graph=True)
        g.square().sum().backward()
        second.append(q.grad)
    torch.testing.assert_close(second[0], second[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("records", [False, True])
def test_spec_properties_hold_through_the_kernel(monkeypatch, records):
    """The definition's properties on inputs the kernel takes (float32, widths of 16),
    without autograd and where it records (the bucket of every leaf runs the kernel
    forward and backward then): a flat tree is SDPA; rows are stochastic (values of
    ones give ones); trees in a batch are independent; a unary node is transparent;
    permuting the members of a family permutes the output alike."""
    forward = count_kernel_calls(monkeypatch, "native_family_attention")
    balanced = [-1] + [0] * 4 + [1 + i // 16 for i in range(64)]
    unary = [-1] + [0] * 4 + [1] + [1 + i // 16 if i >= 16 else 5 for i in range(64)]
    ragged = [-1, 0, 0] + [1] * 5 + [2] * 11

    def run(parents, q, k, v):
        q, k, v = (t.clone().requires_grad_(records) for t in (q, k, v))
        with torch.set_grad_enabled(records):
            y = hsa_graph.hsa(q, k, v, hsa_graph.NestedSignal.from_parents(parents)
                              if isinstance(parents, list) else parents)
        if records:
            y.square().sum().backward()
            assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        return y.detach()

    q, k, v = inputs(64, 2, 16, 16, seed=30)
    flat = Batch.from_data_list([hsa_graph.NestedSignal.from_parents([-1] + [0] * 16)] * 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(4, 16, 2, 16).transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(run(flat, q, k, v), sdpa.reshape(64, 2, 16), atol=2e-6,
                               rtol=1e-5)
    y = run(balanced, q, k, v)
    torch.testing.assert_close(run(balanced, q, k, torch.ones_like(v)),
                               torch.ones_like(v), atol=2e-6, rtol=0)
    torch.testing.assert_close(run(unary, q, k, v), y, atol=2e-6, rtol=1e-5)
    perm = torch.cat([f * 16 + torch.randperm(16, generator=torch.Generator().manual_seed(f))
                      for f in range(4)])
    torch.testing.assert_close(run(balanced, q[perm], k[perm], v[perm]), y[perm], atol=2e-6,
                               rtol=1e-5)
    r = inputs(16, 2, 16, 16, seed=31)
    both = Batch.from_data_list([hsa_graph.NestedSignal.from_parents(p)
                                 for p in (balanced, ragged)])
    together = run(both, *(torch.cat([a, b]) for a, b in zip((q, k, v), r)))
    torch.testing.assert_close(together[:64], y, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(together[64:], run(ragged, *r), atol=2e-6, rtol=1e-5)
    assert any(rows is not None for rows in forward)
