"""KVCache (hsa_graph.ops.kv_cache): the flat cache's steps and prefills equal causal_hsa
on a flat tree (and the dense prefix-tree reference), through growth, drops and adds."""
from __future__ import annotations

import pytest
import torch
from causal_reference import dense_causal_hsa

import hsa_graph
from hsa_graph.ops.causal import causal_hsa
from hsa_graph.ops.kv_cache import KVCache


def flat_reference(q, k, v, include_self=True, scale=None):
    """causal_hsa on a flat tree over the rows ``[L, H, D]``."""
    tree = hsa_graph.NestedSignal.from_parents([-1] + [0] * q.shape[0])
    return causal_hsa(q, k, v, tree, include_self=include_self, scale=scale)


def tokens(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("include_self", [True, False])
def test_steps_equal_causal_hsa_on_a_flat_tree(include_self):
    q, k, v = tokens(3, 40, 2, 4)                          # [B, L, H, D]
    cache = KVCache(3, include_self=include_self)
    ys = torch.stack([cache.step(q[:, i], k[:, i], v[:, i]) for i in range(40)], 1)
    for b in range(3):
        ref = flat_reference(q[b], k[b], v[b], include_self)
        torch.testing.assert_close(ys[b], ref, rtol=0, atol=1e-10)
        dense = dense_causal_hsa([-1] + [0] * 40, q[b], k[b], v[b], include_self)
        torch.testing.assert_close(ys[b], dense, rtol=0, atol=1e-10)
    assert cache.num_tokens == [40, 40, 40]
    if not include_self:          # the first token sees nothing
        assert torch.equal(ys[:, 0], torch.zeros_like(ys[:, 0]))


@pytest.mark.parametrize("include_self", [True, False])
def test_ragged_prefill_then_steps_equal_causal_hsa(include_self):
    q, k, v = tokens(3, 30, 2, 5, seed=1)
    lengths = [7, 0, 19]                                    # one prompt is empty
    cache = KVCache(include_self=include_self, scale=0.7)
    out = cache.prefill(k[:, :19], v[:, :19], lengths, q=q[:, :19])
    assert cache.num_tokens == lengths and out.shape == (3, 19, 2, 5)
    steps = [cache.step(*(t[:, i] for t in (q, k, v)))      # ragged lengths: a mask
             for i in range(19, 30)]
    for b, n in enumerate(lengths):
        # sequence b holds its prompt's rows 0..n-1, then the stepped rows 19..29
        qs, ks, vs = (torch.cat([t[b, :n], t[b, 19:]]) for t in (q, k, v))
        ref = flat_reference(qs, ks, vs, include_self, scale=0.7)
        torch.testing.assert_close(out[b, :n], ref[:n], rtol=0, atol=1e-10)
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))   # padding rows
        torch.testing.assert_close(torch.stack([s[b] for s in steps]), ref[n:],
                                   rtol=0, atol=1e-10)


def test_buffers_grow_by_doubling_and_steps_write_in_place():
    q, k, v = tokens(2, 100, 1, 3, seed=2)
    cache = KVCache(2)
    capacities, moved = [], 0
    for i in range(100):
        before = None if cache._keys is None else cache._keys.data_ptr()
        cache.step(q[:, i], k[:, i], v[:, i])
        capacities.append(cache.capacity)
        moved += before is not None and cache._keys.data_ptr() != before
    # 16 -> 32 -> 64 -> 128: three regrowths in 100 steps, none between them
    assert sorted(set(capacities)) == [16, 32, 64, 128] and moved == 3
    # keys and values [B=2, H=1, C=128, D=3] in float64, host and device lengths
    assert cache.state_bytes() == 2 * (2 * 1 * 128 * 3 * 8) + 2 * (2 * 8)
    assert KVCache.bytes_for(100, heads=1, dim=3) == 100 * 6 * 4


def test_drop_and_add_keep_the_other_sequences():
    q, k, v = tokens(3, 12, 2, 4, seed=3)
    cache = KVCache(include_self=True)
    cache.prefill(k[:, :6], v[:, :6])
    cache.drop([1])
    assert cache.num_tokens == [6, 6] and cache.add() == [2]
    ys = [cache.step(torch.stack([q[0, 6 + i], q[2, 6 + i], q[1, i]]),
                     torch.stack([k[0, 6 + i], k[2, 6 + i], k[1, i]]),
                     torch.stack([v[0, 6 + i], v[2, 6 + i], v[1, i]])) for i in range(6)]
    ys = torch.stack(ys, 1)                                  # [3, 6, H, D]
    for row, (b, first) in enumerate([(0, 6), (2, 6), (1, 0)]):
        ref = flat_reference(q[b, :first + 6], k[b, :first + 6], v[b, :first + 6])
        torch.testing.assert_close(ys[row], ref[first:], rtol=0, atol=1e-10)
    cache.drop(torch.tensor([0, 2]))
    assert cache.num_tokens == [12]


def test_prefill_rows_equals_each_prompt_alone():
    q, k, v = tokens(17, 2, 4, seed=4)
    cache = KVCache(include_self=False)
    y = cache.prefill_rows(q, k, v, [5, 12])
    assert cache.num_tokens == [5, 12]
    for lo, hi in ((0, 5), (5, 17)):
        torch.testing.assert_close(y[lo:hi], flat_reference(q[lo:hi], k[lo:hi], v[lo:hi],
                                                            include_self=False),
                                   rtol=0, atol=1e-10)


def test_half_precision_tokens_come_back_in_their_dtype():
    q, k, v = tokens(2, 3, 2, 4, seed=5, dtype=torch.float32)
    cache = KVCache(2)
    y = [cache.step(*(t[:, i].bfloat16() for t in (q, k, v))) for i in range(3)][-1]
    assert y.dtype == torch.bfloat16 and cache._keys.dtype == torch.float32
    ref = flat_reference(*(t[0].bfloat16().float() for t in (q, k, v)))
    torch.testing.assert_close(y[0].float(), ref[-1], rtol=2e-2, atol=2e-2)


def test_bad_input_is_refused_naming_the_problem():
    cache = KVCache(2)
    x = torch.randn(2, 2, 4)
    with pytest.raises(ValueError, match=r"\[B, H, D\] with B = 2"):
        cache.step(x[:1], x[:1], x[:1])
    with pytest.raises(ValueError, match="v has 3 heads"):
        cache.step(x, x, torch.randn(2, 3, 4))
    bad = x.clone()
    bad[1, 0, 2] = float("nan")
    with pytest.raises(ValueError, match="k holds a NaN or inf in row 1"):
        cache.step(x, bad, x)
    assert cache.num_tokens == [0, 0]                        # nothing stored
    with pytest.raises(TypeError, match="one dtype"):
        cache.step(x, x, x.double())
    cache.step(x, x, x)
    with pytest.raises(ValueError, match="token shapes changed"):
        cache.step(torch.randn(2, 2, 5), torch.randn(2, 2, 5), torch.randn(2, 2, 5))
    with pytest.raises(ValueError, match="token shapes changed"):
        cache.prefill(torch.randn(1, 3, 2, 5), torch.randn(1, 3, 2, 5))
    assert cache.batch_size == 2                             # the refused prompt added nothing
    with pytest.raises(ValueError, match="no sequences"):
        KVCache().step(x, x, x)
    with pytest.raises(ValueError, match="batch_size must be an int >= 0"):
        KVCache(-1)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 9 is outside 0..3"):
        KVCache().prefill(torch.randn(2, 3, 1, 2), torch.randn(2, 3, 1, 2), [1, 9])
    with pytest.raises(TypeError, match="lengths must be ints"):
        KVCache().prefill(torch.randn(2, 3, 1, 2), torch.randn(2, 3, 1, 2), [1, 2.0])
    with pytest.raises(ValueError, match=r"\[P, L, H, D\]"):
        KVCache().prefill(torch.randn(3, 1, 2), torch.randn(3, 1, 2))
    nan_prompt = torch.randn(2, 3, 1, 2)
    nan_prompt[1, 2, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="prompt 1, token 2"):
        KVCache().prefill(nan_prompt, nan_prompt)
    # a NaN in a padding row past the prompt's length is ignored
    assert KVCache().prefill(nan_prompt, nan_prompt, [3, 2]) is None
    with pytest.raises(ValueError, match="add up to 4 rows"):
        KVCache().prefill_rows(x, x, x, [1, 3])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        KVCache().prefill_rows(x, x, x, [0, 2])
    with pytest.raises(ValueError, match="outside 0..1"):
        cache.drop(2)
    with pytest.raises(ValueError, match="distinct"):
        cache.drop([0, 0])
    with pytest.raises(TypeError, match="indices must be"):
        cache.drop(0.5)
