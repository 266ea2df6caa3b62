"""HSACache (hsa_graph.ops.cache): token-by-token outputs equal causal_hsa on the tree the
appends built, which equals the dense prefix-tree reference."""
from __future__ import annotations

import random

import pytest
import torch
from causal_reference import dense_causal_hsa

import hsa_graph
import hsa_graph.typing
from hsa_graph.ops.cache import HSACache, parents_of_moves
from hsa_graph.ops.causal import causal_hsa


@pytest.fixture(autouse=True, params=["fused", "eager"])
def step_path(request, monkeypatch):
    """Every test here runs with the fused step kernel (numba) and with the eager step."""
    if request.param == "fused":
        pytest.importorskip("numba")
    monkeypatch.setattr(hsa_graph.typing, "WITH_NUMBA", request.param == "fused")
    return request.param


def run_cache(q, k, v, moves, include_self=True):
    cache = HSACache(include_self=include_self)
    ys = [cache.append(q[i], k[i], v[i], **moves[i]) for i in range(q.shape[0])]
    return cache, torch.stack(ys)


def random_moves(n: int, seed: int, max_depth: int = 4):
    rng = random.Random(seed)
    depth = rng.randint(1, max_depth)
    moves = [dict(depth=depth)]
    for _ in range(n - 1):
        new_depth = rng.randint(1, max_depth) if rng.random() < 0.2 else depth
        attach = rng.randint(0, min(depth, new_depth) - 1)
        moves.append(dict(attach=attach, depth=new_depth))
        depth = new_depth
    return moves


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("include_self", [True, False])
def test_cache_equals_full_recomputation(seed, include_self):
    n = 40
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    cache, ys = run_cache(q, k, v, random_moves(n, seed), include_self)
    tree = hsa_graph.NestedSignal.from_parents(cache.parent)
    assert tree.num_leaves == n
    full = causal_hsa(q, k, v, tree, include_self=include_self)
    torch.testing.assert_close(ys, full, atol=1e-12, rtol=1e-10)


def test_cache_equals_dense_reference_on_text_moves():
    # doc -> paragraph -> sentence -> token: 2 = same sentence, 1 = new sentence,
    # 0 = new paragraph
    attach = [None, 2, 2, 1, 2, 0, 2, 2, 1, 1, 2]
    moves = [dict(depth=3)] + [dict(attach=a) for a in attach[1:]]
    n = len(moves)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    cache, ys = run_cache(q, k, v, moves)
    assert cache.depth == 3
    ref = dense_causal_hsa(cache.parent, q, k, v)
    torch.testing.assert_close(ys, ref, atol=1e-12, rtol=1e-10)


def test_cache_on_flat_tree_is_causal_softmax():
    n = 30
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    _, ys = run_cache(q, k, v, [{}] * n)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(ys, ref.transpose(0, 1), atol=1e-12, rtol=1e-10)


def test_cache_keeps_only_the_right_spine():
    cache = HSACache()
    x = torch.randn(1, 4)
    cache.append(x, x, x, depth=3)
    for i in range(60):  # sentences of 5 tokens, paragraphs of 4 sentences
        attach = 0 if i % 20 == 19 else 1 if i % 5 == 4 else 2
        cache.append(x, x, x, attach=attach)
    # completed children kept: paragraphs under the root, sentences of the open
    # paragraph, tokens of the open sentence; never the closed sentences' tokens
    assert [lvl.size for lvl in cache.levels] == [3, 0, 0]
    assert cache.num_tokens == 61


def test_bad_appends_raise():
    cache = HSACache()
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="attach must be None"):
        cache.append(x, x, x, attach=0)
    cache.append(x, x, x, depth=2)
    with pytest.raises(ValueError, match=r"attach must be a depth in 0..1"):
        cache.append(x, x, x, attach=2)
    with pytest.raises(ValueError, match="one token"):
        cache.append(x[None], x[None], x[None])
    with pytest.raises(ValueError, match="token shapes changed"):
        cache.append(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        cache.append(x, x, x, depth=0)


def test_absurd_depth_is_refused_at_once():
    # an absurd depth once ran for minutes, opening one level per unit of depth
    import time

    cache = HSACache()
    q = torch.randn(2, 4)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="max_depth"):
        cache.append(q, q, q, depth=10**9)
    assert time.perf_counter() - start < 1.0
    deep = HSACache(max_depth=10**9)   # a deeper cache is one argument away
    assert deep.max_depth == 10**9
    with pytest.raises(ValueError, match="max_depth"):
        HSACache(max_depth=0)


@pytest.mark.parametrize("where", [dict(depth=2**70), dict(depth=[2**70, None]),
                                   dict(attach=[None, -2**70]), dict(attach=2**70)])
def test_placements_beyond_64_bits_are_refused_by_name(where):
    """An int no host array can hold is a ValueError naming the placement (not numpy's
    OverflowError), and the cache is left as it was."""
    from hsa_graph.ops.cache import BatchedHSACache

    cache = BatchedHSACache(batch_size=2)
    q = torch.randn(2, 2, 2, 4, dtype=torch.float64)
    cache.step(q[0], q[0], q[0], depth=2)
    name = "depth" if "depth" in where else "attach"
    with pytest.raises(ValueError, match=f"{name}.* is out of range"):
        cache.step(q[1], q[1], q[1], **where)
    assert cache.num_tokens == [1, 1] and cache.depths == [2, 2]
    with pytest.raises(ValueError, match="out of range"):
        parents_of_moves([dict(depth=2**70)])


def test_mixed_dtypes_across_appends_are_refused():
    cache = HSACache()
    q = torch.randn(2, 4)
    cache.append(q, q, q, depth=2)
    with pytest.raises(ValueError, match="float64"):
        cache.append(q.double(), q.double(), q.double())


# --------------------------------------------------------------------- BatchedHSACache
from hsa_graph.ops.cache import BatchedHSACache  # noqa: E402

DT = torch.float64


def tokens(n, b, seed, h=2, d=4, dv=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, b, h, d, generator=g, dtype=DT),
            torch.randn(n, b, h, d, generator=g, dtype=DT),
            torch.randn(n, b, h, dv, generator=g, dtype=DT))


def reference(q, k, v, moves, include_self):
    """causal_hsa on the tree that ``moves`` build (one sequence)."""
    tree = hsa_graph.NestedSignal.from_parents(parents_of_moves(moves))
    return causal_hsa(q, k, v, tree, include_self=include_self)


def step_all(cache, q, k, v, moves):
    """One batched step per token row: moves[b][t] places token t of sequence b."""
    out = []
    for t in range(q.shape[0]):
        out.append(cache.step(q[t], k[t], v[t],
                              attach=[m[t].get("attach") for m in moves],
                              depth=[m[t].get("depth") for m in moves]))
    return torch.stack(out)                                    # [T, B, H, Dv]


def test_parents_of_moves_matches_hsa_cache():
    for seed in range(5):
        moves = random_moves(30, seed)
        cache = HSACache()
        x = torch.randn(1, 2)
        for m in moves:
            cache.append(x, x, x, **m)
        assert parents_of_moves(moves) == cache.parent


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_batched_steps_equal_causal_hsa_on_ragged_trees(seed, include_self):
    b, n = 5, 25
    q, k, v = tokens(n, b, seed)
    # ragged: different depths and attach patterns per sequence, one flat
    moves = [random_moves(n, 10 * seed + r, max_depth=1 + r) for r in range(b)]
    cache = BatchedHSACache(b, include_self=include_self)
    ys = step_all(cache, q, k, v, moves)
    assert cache.num_tokens == [n] * b
    for r in range(b):
        ref = reference(q[:, r], k[:, r], v[:, r], moves[r], include_self)
        torch.testing.assert_close(ys[:, r], ref, atol=1e-10, rtol=1e-10)
    # O(b * depth) state: a flat sequence holds its tokens, the others far fewer
    assert cache.state_bytes(per_sequence=True) * b == cache.state_bytes()


@pytest.mark.parametrize("include_self", [True, False])
def test_prefill_then_steps_equal_causal_hsa(include_self):
    b, prompt, more = 4, 30, 12
    q, k, v = tokens(prompt + more, b, 7)
    moves = [random_moves(prompt + more, 50 + r, max_depth=1 + r) for r in range(b)]
    trees = [hsa_graph.NestedSignal.from_parents(parents_of_moves(m[:prompt]))
             for m in moves]
    batch = hsa_graph.collate(trees)
    flat = lambda t: t[:prompt].transpose(0, 1).reshape(b * prompt, *t.shape[2:])  # noqa
    cache = BatchedHSACache(include_self=include_self)
    y_prompt = cache.prefill(flat(q), flat(k), flat(v), batch)
    assert cache.batch_size == b and cache.num_tokens == [prompt] * b
    ys = step_all(cache, q[prompt:], k[prompt:], v[prompt:], [m[prompt:] for m in moves])
    for r in range(b):
        ref = reference(q[:, r], k[:, r], v[:, r], moves[r], include_self)
        torch.testing.assert_close(y_prompt[r * prompt:(r + 1) * prompt], ref[:prompt],
                                   atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ys[:, r], ref[prompt:], atol=1e-10, rtol=1e-10)


def test_prefill_state_equals_stepping_state():
    n = 40
    q, k, v = tokens(n, 1, 3)
    moves = random_moves(n, 3, max_depth=4)
    stepped = BatchedHSACache(1)
    step_all(stepped, q, k, v, [moves])
    filled = BatchedHSACache()
    filled.prefill(q[:, 0], k[:, 0], v[:, 0],
                   hsa_graph.NestedSignal.from_parents(parents_of_moves(moves)))
    assert filled.completed_per_level == stepped.completed_per_level
    assert filled.depths == stepped.depths


def test_prefill_of_ragged_prompts_into_a_running_batch():
    # prompts of different lengths join a batch that is already generating
    q, k, v = tokens(20, 3, 11)
    moves = [random_moves(20, 60 + r, max_depth=3) for r in range(3)]
    cache = BatchedHSACache(1)
    step_all(cache, q[:8, :1], k[:8, :1], v[:8, :1], moves[:1])
    lengths = [5, 13]
    trees = [hsa_graph.NestedSignal.from_parents(parents_of_moves(moves[r + 1][:n]))
             for r, n in enumerate(lengths)]
    rows = lambda t: torch.cat([t[:n, r + 1] for r, n in enumerate(lengths)])  # noqa
    cache.prefill(rows(q), rows(k), rows(v), hsa_graph.collate(trees))
    assert cache.num_tokens == [8, 5, 13]
    # one more token each (different positions in their trees), then compare
    t_of = [8, 5, 13]
    qn, kn, vn = (torch.stack([t[i, r] for r, i in enumerate(t_of)]) for t in (q, k, v))
    y = cache.step(qn, kn, vn, attach=[moves[r][i].get("attach") for r, i in enumerate(t_of)],
                   depth=[moves[r][i].get("depth") for r, i in enumerate(t_of)])
    for r, i in enumerate(t_of):
        ref = reference(q[:i + 1, r], k[:i + 1, r], v[:i + 1, r], moves[r][:i + 1], True)
        torch.testing.assert_close(y[r], ref[-1], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("include_self", [True, False])
def test_drop_and_add_leave_the_other_sequences_exact(include_self):
    n = 30
    q, k, v = tokens(n, 4, 5)
    moves = [random_moves(n, 70 + r, max_depth=4) for r in range(4)]
    cache = BatchedHSACache(3, include_self=include_self)
    outs = {0: [], 1: [], 2: []}            # sequence id -> outputs
    rows = [0, 1, 2]                        # row -> sequence id
    start = {0: 0, 1: 0, 2: 0}
    for t in range(n):
        if t == 10:                         # sequence 1 finishes; sequence 3 starts
            cache.drop(rows.index(1))
            rows.remove(1)
            cache.add(1)
            rows.append(3)
            outs[3], start[3] = [], t
        pos = [t - start[s] for s in rows]
        y = cache.step(torch.stack([q[p, s] for s, p in zip(rows, pos)]),
                       torch.stack([k[p, s] for s, p in zip(rows, pos)]),
                       torch.stack([v[p, s] for s, p in zip(rows, pos)]),
                       attach=[moves[s][p].get("attach") for s, p in zip(rows, pos)],
                       depth=[moves[s][p].get("depth") for s, p in zip(rows, pos)])
        for r, s in enumerate(rows):
            outs[s].append(y[r])
    for s in (0, 1, 2, 3):
        m = len(outs[s])
        ref = reference(q[:m, s], k[:m, s], v[:m, s], moves[s][:m], include_self)
        torch.testing.assert_close(torch.stack(outs[s]), ref, atol=1e-10, rtol=1e-10)


def test_extend_moves_sequences_in():
    q, k, v = tokens(12, 2, 9)
    moves = [random_moves(12, 80 + r, max_depth=3) for r in range(2)]
    a, b = BatchedHSACache(1), BatchedHSACache(1)
    step_all(a, q[:6, :1], k[:6, :1], v[:6, :1], moves[:1])
    step_all(b, q[:9, 1:], k[:9, 1:], v[:9, 1:], moves[1:])
    assert a.extend(b) == [1] and b.batch_size == 0 and a.num_tokens == [6, 9]
    y = a.step(torch.stack([q[6, 0], q[9, 1]]), torch.stack([k[6, 0], k[9, 1]]),
               torch.stack([v[6, 0], v[9, 1]]),
               attach=[moves[0][6].get("attach"), moves[1][9].get("attach")],
               depth=[moves[0][6].get("depth"), moves[1][9].get("depth")])
    for r, i in ((0, 6), (1, 9)):
        ref = reference(q[:i + 1, r], k[:i + 1, r], v[:i + 1, r], moves[r][:i + 1], True)
        torch.testing.assert_close(y[r], ref[-1], atol=1e-10, rtol=1e-10)


def test_batched_state_is_b_times_depth_not_tokens():
    # 16-ary tree of depth 3 over 4,096 tokens: the state holds <= 15 children per level
    depth, n = 3, 16 ** 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 4, generator=g) for _ in range(3))
    parent = [-1]
    for d in range(1, depth + 1):   # balanced: node ids level by level
        first = (16 ** (d - 1) - 1) // 15
        parent += [first + i // 16 for i in range(16 ** d)]
    cache = BatchedHSACache()
    cache.prefill(q, k, v, hsa_graph.NestedSignal.from_parents(parent))
    assert cache.capacity == (depth, 15)
    flat_kv = 2 * n * 2 * 4 * 4
    assert cache.state_bytes() * 20 < flat_kv
    assert cache.state_bytes() < BatchedHSACache.bytes_for(depth, 15, 2, 4) + 200


def test_batched_bad_input_names_the_row():
    cache = BatchedHSACache(3)
    x = torch.randn(3, 2, 4, dtype=DT)
    with pytest.raises(ValueError, match="B = 3"):
        cache.step(x[:2], x[:2], x[:2])
    with pytest.raises(TypeError, match="one dtype"):
        cache.step(x, x.float(), x)
    bad = x.clone()
    bad[2, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="row 2"):
        cache.step(bad, x, x, check_finite=True)     # opt-in, as in causal_hsa
    with pytest.raises(ValueError, match=r"attach\[1\].*no token yet"):
        cache.step(x, x, x, attach=[None, 0, None])
    with pytest.raises(ValueError, match=r"depth\[0\] must be an int >= 1"):
        cache.step(x, x, x, depth=[0, 1, 1])
    with pytest.raises(ValueError, match=r"depth\[2\].*max_depth"):
        cache.step(x, x, x, depth=[1, 1, 10 ** 9])
    with pytest.raises(TypeError, match=r"depth\[1\] must be an int"):
        cache.step(x, x, x, depth=[1, 2.0, 1])
    with pytest.raises(ValueError, match="one entry per sequence"):
        cache.step(x, x, x, depth=[1, 2])
    assert cache.num_tokens == [0, 0, 0]     # refused calls change nothing
    cache.step(x, x, x, depth=[2, 1, 3])
    with pytest.raises(ValueError, match=r"attach\[2\] must be a depth in 0..2"):
        cache.step(x, x, x, attach=[0, 0, 3])
    with pytest.raises(ValueError, match=r"attach\[1\] must be a depth in 0..0"):
        cache.step(x, x, x, attach=torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="token shapes changed"):
        cache.step(x.float(), x.float(), x.float())
    with pytest.raises(ValueError, match="outside 0..2"):
        cache.drop([3])
    with pytest.raises(ValueError, match="distinct"):
        cache.drop([1, 1])
    with pytest.raises(TypeError, match="indices"):
        cache.drop([0.5])
    assert cache.num_tokens == [1, 1, 1]
    with pytest.raises(ValueError, match="no sequences"):
        BatchedHSACache().step(x, x, x)


def test_prefill_bad_input():
    cache = BatchedHSACache()
    tree = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 1, 2])
    x = torch.randn(3, 2, 4, dtype=DT)
    with pytest.raises(ValueError, match="3 leaves"):
        cache.prefill(x[:2], x[:2], x[:2], tree)
    bad = x.clone()
    bad[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="row 1"):
        cache.prefill(bad, x, x, tree)
    scattered = hsa_graph.NestedSignal.from_parents([-1, 0, 0, 1, 2, 1])
    with pytest.raises(ValueError, match="contiguous"):
        cache.prefill(x, x, x, scattered)
    with pytest.raises(ValueError, match="max_depth"):
        BatchedHSACache(max_depth=1).prefill(x, x, x, tree)
    assert cache.batch_size == 0


def test_nan_check_is_opt_in_and_a_refused_step_changes_nothing():
    q, k, v = tokens(6, 2, 21)
    moves = [random_moves(6, 90 + r, max_depth=3) for r in range(2)]
    cache = BatchedHSACache(2)
    step_all(cache, q[:5], k[:5], v[:5], [m[:5] for m in moves])
    where = dict(attach=[m[5].get("attach") for m in moves],
                 depth=[m[5].get("depth") for m in moves])
    for name in ("q", "k", "v"):
        bad = {"q": q[5], "k": k[5], "v": v[5]}
        bad[name] = bad[name].clone()
        bad[name][1, 0, 0] = float("inf")
        with pytest.raises(ValueError, match=rf"{name} holds a NaN or inf in row 1"):
            cache.step(bad["q"], bad["k"], bad["v"], check_finite=True, **where)
    assert cache.num_tokens == [5, 5]
    y = cache.step(q[5], k[5], v[5], check_finite=True, **where)
    for r in range(2):
        ref = reference(q[:, r], k[:, r], v[:, r], moves[r], True)
        torch.testing.assert_close(y[r], ref[-1], atol=1e-10, rtol=1e-10)
    single = HSACache()
    x = torch.randn(2, 4, dtype=DT)
    with pytest.raises(ValueError, match="row 0"):
        single.append(x * float("nan"), x, x, check_finite=True)
    assert single.num_tokens == 0


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten calls (views included) that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(depth: int, batch: int, n: int) -> int:
    """aten calls of one step once ``n`` tokens per sequence are cached in trees of
    ``depth`` levels (families of 4; the step continues the newest one)."""
    cache = BatchedHSACache(batch)
    x = torch.randn(n + 1, batch, 2, 4, dtype=DT)
    for i in range(n):
        closes = next(e for e in range(depth) if i % 4 ** (e + 1) or e == depth - 1)
        cache.step(x[i], x[i], x[i], depth=depth if i == 0 else None,
                   attach=None if i == 0 else depth - 1 - closes)
    counter = _CountOps()
    with counter:
        cache.step(x[n], x[n], x[n], attach=depth - 1)
    return counter.calls


def test_step_is_a_fixed_handful_of_ops_not_a_loop_over_levels_or_tokens():
    # every level's sibling logits are one batched matmul: only the b-wide lambda
    # recursion (two ops a level) grows with the depth, nothing with B or the tokens
    shallow = _ops_per_step(depth=3, batch=1, n=64)
    assert shallow <= 200
    assert _ops_per_step(depth=3, batch=1, n=256) == shallow
    assert _ops_per_step(depth=3, batch=6, n=64) <= shallow + 5
    assert _ops_per_step(depth=6, batch=1, n=64) <= shallow + 3 * 3 + 3
