"""Position embeddings per geometry (hsa_graph.geometry)."""
import math

import networkx as nx
import pytest
import torch
from torch_geometric.data import Batch, Data
from torch_geometric.transforms import AddRandomWalkPE
from torch_geometric.utils import to_undirected

import hsa_graph
from hsa_graph import NestedSignal, Node
from hsa_graph.geometry import (
    FieldNameEmbedding,
    PositionEncoder,
    fourier_encoding,
    grid_encoding,
    laplacian_encoding,
    random_fourier_frequencies,
    random_walk_encoding,
    sequence_encoding,
    set_encoding,
    sinusoidal_encoding,
)


def vec(seed, dim=6):
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ sequence / grid
def test_sinusoidal_matches_the_transformer_formula():
    index = torch.tensor([0, 1, 2, 7, 50, 1000])
    dim = 10
    got = sinusoidal_encoding(index, dim)
    for r, p in enumerate(index.tolist()):
        for i in range(dim // 2):
            angle = p / 10000 ** (2 * i / dim)
            assert got[r, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert got[r, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    # dot products depend on the offset only: sum_i cos(offset * omega_i)
    a, b = sinusoidal_encoding(torch.tensor([3, 8]), dim), sinusoidal_encoding(
        torch.tensor([103, 108]), dim)
    assert torch.allclose(a[0] @ a[1], b[0] @ b[1], atol=1e-4)


def test_fourier_features_closed_form_and_kernel():
    w = random_fourier_frequencies(1, 4, sigma=0.5, seed=7)
    x = torch.tensor([0.0, 1.0, 2.5])
    got = fourier_encoding(x, w)
    assert got.shape == (3, 8)
    for r, p in enumerate(x.tolist()):
        angles = [p * w[0, f].item() for f in range(4)]
        expected = [math.cos(a) / 2 for a in angles] + [math.sin(a) / 2 for a in angles]
        assert got[r].tolist() == pytest.approx(expected, abs=1e-6)
    # unit norm, and <z(x), z(y)> = mean_f cos((x - y) w_f)
    assert torch.allclose(got.norm(dim=1), torch.ones(3))
    assert (got[0] @ got[2]).item() == pytest.approx(torch.cos(2.5 * w[0]).mean().item(),
                                                     abs=1e-6)
    # many features approximate the Gaussian kernel exp(-sigma^2 d^2 / 2)
    sigma = 0.3
    many = fourier_encoding(torch.arange(8.0), random_fourier_frequencies(1, 20000, sigma))
    kernel = many @ many[0]
    expected = torch.exp(-sigma ** 2 * torch.arange(8.0) ** 2 / 2)
    assert torch.allclose(kernel, expected, atol=0.02)


def test_sequence_encoding_kinds_and_seeds():
    index = torch.arange(6)
    fourier = sequence_encoding(index, 8, sigma=0.7, seed=3)
    assert torch.equal(fourier, fourier_encoding(index, random_fourier_frequencies(1, 4, 0.7, 3)))
    assert torch.equal(fourier, sequence_encoding(index, 8, sigma=0.7, seed=3))  # fixed
    assert not torch.allclose(fourier, sequence_encoding(index, 8, sigma=0.7, seed=4))
    assert torch.equal(sequence_encoding(index, 8, kind="sinusoidal"),
                       sinusoidal_encoding(index, 8))


def test_grid_sinusoidal_is_separable():
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(5), indexing="ij")
    rc = torch.stack([rows.flatten(), cols.flatten()], 1)
    g = grid_encoding(rc, 16, kind="sinusoidal")
    assert torch.equal(g[:, :8], sinusoidal_encoding(rc[:, 0], 8))
    assert torch.equal(g[:, 8:], sinusoidal_encoding(rc[:, 1], 8))
    row_part = sinusoidal_encoding(rc[:, 0], 8)
    col_part = sinusoidal_encoding(rc[:, 1], 8)
    assert torch.allclose(g @ g.T, row_part @ row_part.T + col_part @ col_part.T, atol=1e-5)


def test_grid_fourier_is_two_dimensional_and_shift_invariant():
    rc = torch.tensor([[0, 0], [1, 2], [5, 5], [6, 7]])
    g = grid_encoding(rc, 32, sigma=0.4, seed=1)
    w = random_fourier_frequencies(2, 16, 0.4, 1)
    assert torch.allclose(g, fourier_encoding(rc, w))
    assert torch.allclose(g[0] @ g[1], g[2] @ g[3], atol=1e-5)  # same offset (1, 2)
    # not separable: the features mix rows and columns
    angle = rc.double() @ w.double()
    assert torch.allclose(g[:, :16].double(), angle.cos() / 4, atol=1e-6)


def test_set_encoding_is_zero():
    assert torch.equal(set_encoding(3, 5), torch.zeros(3, 5))


@pytest.mark.parametrize("call", [
    lambda: sinusoidal_encoding(torch.arange(3), 5),
    lambda: sequence_encoding(torch.arange(3), 8, kind="rope"),
    lambda: grid_encoding(torch.arange(3), 8),
    lambda: grid_encoding(torch.zeros(3, 2), 6, kind="sinusoidal"),
    lambda: random_fourier_frequencies(1, 4, sigma=0.0),
    lambda: fourier_encoding(torch.zeros(3, 2), torch.zeros(3, 4)),
])
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


# ---------------------------------------------------------------------- field names
def test_field_names_same_name_same_vector_and_growth():
    emb = FieldNameEmbedding(4, capacity=3)
    a = emb(["title", "body"])
    b = emb(["body", "image", "title"])
    assert torch.equal(a[0], b[2]) and torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    assert emb.vocabulary == {"title": 0, "body": 1, "image": 2}
    with pytest.raises(ValueError, match="vocabulary is full"):
        emb(["caption"])
    with pytest.raises(TypeError, match="not a string"):
        emb(["title", 3])


def test_field_names_state_dict_keeps_the_vocabulary():
    emb = FieldNameEmbedding(4, vocabulary=["a", "b"])
    emb(["c"])
    other = FieldNameEmbedding(4)
    other.load_state_dict(emb.state_dict())
    assert other.vocabulary == emb.vocabulary
    assert torch.equal(other(["c", "a"]), emb(["c", "a"]))


def test_field_names_hashed_are_stable():
    import zlib
    emb = FieldNameEmbedding(3, num_buckets=7)
    rows = emb.index(["headline", "body", "headline"])
    assert rows.tolist() == [zlib.crc32(b"headline") % 7, zlib.crc32(b"body") % 7,
                             zlib.crc32(b"headline") % 7]
    assert emb.vocabulary == {}  # nothing grows
    with pytest.raises(ValueError, match="cannot take"):
        FieldNameEmbedding(3, num_buckets=7, text_embedding=lambda names: None)


def test_field_names_from_a_text_embedding():
    def spell(names):  # a deterministic "text embedding": letter counts of a..d
        return torch.tensor([[name.count(c) for c in "abcd"] for name in names],
                            dtype=torch.float)
    emb = FieldNameEmbedding(4, text_embedding=spell, learnable=False)
    got = emb(["abba", "dad", "abba"])
    assert got.tolist() == [[2, 2, 0, 0], [1, 0, 0, 2], [2, 2, 0, 0]]
    assert not emb.weight.requires_grad
    emb.reset_parameters()  # keeps text-initialised rows
    assert emb(["dad"]).tolist() == [[1, 0, 0, 2]]
    with pytest.raises(ValueError, match="text_embedding returned shape"):
        FieldNameEmbedding(3, text_embedding=spell)(["x"])


# --------------------------------------------------------------------------- graphs
def _karate():
    """Zachary's karate club (shipped with networkx): 34 members, 78 friendships."""
    graph = nx.karate_club_graph()
    edges = torch.tensor(list(graph.edges)).T
    return graph, edges


def _family_graphs():
    """Three families interleaved in node order: a karate club, a path, a star."""
    _, karate = _karate()
    fam = torch.tensor([0] * 34 + [1] * 9 + [2] * 6)
    perm = torch.randperm(fam.numel(), generator=torch.Generator().manual_seed(0))
    node_of = [perm[(fam[perm] == f).nonzero().flatten()] for f in range(3)]
    family = torch.empty_like(fam)
    for f in range(3):
        family[node_of[f]] = f
    local = [karate, torch.stack([torch.arange(8), torch.arange(1, 9)]),
             torch.stack([torch.zeros(5, dtype=torch.long), torch.arange(1, 6)])]
    edges = torch.cat([node_of[f][e] for f, e in enumerate(local)], 1)
    return edges, family, node_of, local


def test_laplacian_equals_pyg_transform_per_family():
    pytest.importorskip("scipy")  # PyG's AddLaplacianEigenvectorPE needs it
    from torch_geometric.transforms import AddLaplacianEigenvectorPE
    edges, family, node_of, local = _family_graphs()
    k = 3
    pe = laplacian_encoding(edges, family, k)
    for f in (0, 1):  # karate and path have distinct eigenvalues (the star does not)
        n = node_of[f].numel()
        data = Data(edge_index=to_undirected(local[f], num_nodes=n), num_nodes=n)
        ref = AddLaplacianEigenvectorPE(k, attr_name="pe", is_undirected=True)(data).pe.float()
        got = pe[node_of[f]]
        sign = torch.sign((got * ref).sum(0))  # PyG flips signs at random
        torch.testing.assert_close(got, ref * sign, atol=1e-5, rtol=0)


def test_laplacian_is_an_eigenbasis_of_the_normalised_laplacian():
    edges, family, node_of, local = _family_graphs()
    pe = laplacian_encoding(edges, family, 4).double()
    for f in range(3):
        n = node_of[f].numel()
        a = torch.zeros(n, n, dtype=torch.float64)
        u = to_undirected(local[f], num_nodes=n)
        a[u[0], u[1]] = 1
        d = a.sum(1).rsqrt()
        lap = torch.eye(n, dtype=torch.float64) - d[:, None] * a * d[None]
        vectors = pe[node_of[f]]
        values = torch.linalg.eigvalsh(lap)
        rayleigh = (vectors * (lap @ vectors)).sum(0)
        torch.testing.assert_close(rayleigh, values[1:5], atol=1e-5, rtol=0)
        torch.testing.assert_close(lap @ vectors, vectors * rayleigh, atol=1e-5, rtol=0)
        torch.testing.assert_close(vectors.T @ vectors, torch.eye(4, dtype=torch.float64),
                                   atol=1e-5, rtol=0)
        # signs are fixed: in node order, each column's first entry of largest
        # magnitude (up to rounding) is positive
        in_order = vectors[torch.argsort(node_of[f])].abs()
        top = (in_order >= in_order.amax(0) - 1e-6).int().argmax(0)
        assert bool((vectors[torch.argsort(node_of[f])][top, torch.arange(4)] > 0).all())


def test_laplacian_small_families_and_large_ones():
    pe = laplacian_encoding(torch.tensor([[0], [1]]), torch.tensor([0, 0, 1]), 3)
    # a 2-node family has one non-trivial eigenvector, a single node none
    assert pe[:, 1:].abs().max() == 0 and pe[2].abs().max() == 0
    assert pe[0, 0].abs().item() == pytest.approx(2 ** -0.5, abs=1e-6)
    pytest.importorskip("scipy")
    edges, family, _, _ = _family_graphs()
    dense = laplacian_encoding(edges, family, 3)
    sparse = laplacian_encoding(edges, family, 3, dense_limit=16)  # karate goes to PyG
    torch.testing.assert_close(dense, sparse, atol=1e-4, rtol=0)


def test_random_walk_equals_pyg_transform_per_family():
    edges, family, node_of, local = _family_graphs()
    pe = random_walk_encoding(edges, family, 6)
    for f in range(3):
        n = node_of[f].numel()
        data = Data(edge_index=to_undirected(local[f], num_nodes=n), num_nodes=n)
        ref = AddRandomWalkPE(6, attr_name="pe")(data).pe
        torch.testing.assert_close(pe[node_of[f]], ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(pe, random_walk_encoding(edges, family, 6, dense_limit=8),
                               atol=1e-6, rtol=0)


def test_family_graph_errors():
    with pytest.raises(ValueError, match="different families"):
        laplacian_encoding(torch.tensor([[0], [2]]), torch.tensor([0, 0, 1]), 2)
    with pytest.raises(ValueError, match="outside"):
        random_walk_encoding(torch.tensor([[0], [5]]), torch.tensor([0, 0, 1]), 2)
    with pytest.raises(ValueError, match="positive"):
        random_walk_encoding(torch.zeros(2, 0, dtype=torch.long), torch.tensor([0]), 0)


# -------------------------------------------------------------------------- module
def mixed_tree(order=(0, 1, 2, 3)):
    """A document touching every geometry: keyvalue root; a sequence, a grid, a set
    (children in ``order``) and a graph (the karate club) as fields."""
    graph, edges = _karate()
    set_items = [vec(10), vec(11), [vec(12), vec(13)], vec(14)]
    return NestedSignal.from_nested({
        "title": [vec(i) for i in range(4)],
        "image": Node([[vec(20), vec(21)], [vec(22), vec(23)], [vec(24), vec(25)]], "grid"),
        "tags": Node([set_items[i] for i in order], "set"),
        "club": Node([vec(100 + i) for i in range(34)], "graph", edges=edges.T.tolist()),
    })


def test_encoder_groups_nodes_by_parent_geometry():
    tree = mixed_tree()
    enc = PositionEncoder(5, dim=8, kind="sinusoidal", graph_dim=3)
    feats = enc.features(tree)
    parent = tree.parent
    names = tree.geometry_names()
    for name, (nodes, _) in feats.items():
        assert all(names[int(parent[u])] == name for u in nodes)
    title = feats["sequence"][0]
    assert torch.equal(feats["sequence"][1], sinusoidal_encoding(tree.position[title, 0], 8))
    grid_nodes = feats["grid"][0]
    assert torch.equal(feats["grid"][1],
                       grid_encoding(tree.position[grid_nodes], 8, kind="sinusoidal"))
    club_nodes = feats["graph"][0]
    graph_node = names.index("graph")
    assert torch.equal(club_nodes, (parent == graph_node).nonzero().flatten())
    _, edges = _karate()
    ref = laplacian_encoding(edges, torch.zeros(34, dtype=torch.long), 3)
    torch.testing.assert_close(feats["graph"][1], ref)
    assert [tree.key[u] for u in feats["keyvalue"][0]] == ["title", "image", "tags", "club"]

    pos = enc(tree)
    assert pos.shape == (tree.num_nodes, 5)
    for name, (nodes, raw) in feats.items():
        torch.testing.assert_close(pos[nodes], enc.lins[name](raw))
    covered = torch.cat([nodes for nodes, _ in feats.values()])
    rest = torch.ones(tree.num_nodes, dtype=torch.bool)
    rest[covered] = False
    set_node = [u for u, g in enumerate(names) if g == "set"][0]
    set_children = (parent == set_node).nonzero().flatten()
    assert bool(rest[set_children].all()) and bool(rest[0])  # set children, root
    assert bool(pos[rest].eq(0).all())


def test_encoder_fourier_features_equal_the_public_functions():
    tree = mixed_tree()
    enc = PositionEncoder(3, dim=12, sigma=0.6, seed=5)
    feats = enc.features(tree)
    nodes, raw = feats["sequence"]
    torch.testing.assert_close(raw, sequence_encoding(tree.position[nodes, 0], 12, sigma=0.6,
                                                      seed=5))
    nodes, raw = feats["grid"]
    torch.testing.assert_close(raw, grid_encoding(tree.position[nodes], 12, sigma=0.6, seed=5))
    # moved with the module
    assert enc.double()(tree).dtype == torch.float64


def test_encoder_keyvalue_same_name_same_vector():
    a = NestedSignal.from_nested({"x": vec(0), "y": vec(1), "z": {"x": vec(2), "w": vec(3)}})
    enc = PositionEncoder(4, heads=3)
    pos = enc(a)  # nodes: 0 root, 1 x, 2 y, 3 z, 4 z.x, 5 z.w
    assert pos.shape == (6, 3, 4)
    assert torch.equal(pos[1], pos[4])
    assert not torch.equal(pos[1], pos[2])
    assert enc.field_names.vocabulary == {"x": 0, "y": 1, "z": 2, "w": 3}


def test_graph_random_walk_encoding_in_the_encoder():
    tree = mixed_tree()
    enc = PositionEncoder(4, graph="random_walk", graph_dim=5)
    nodes, raw = enc.features(tree)["graph"]
    graph, edges = _karate()
    data = Data(edge_index=to_undirected(edges, num_nodes=34), num_nodes=34)
    torch.testing.assert_close(raw, AddRandomWalkPE(5, attr_name="pe")(data).pe,
                               atol=1e-6, rtol=0)


def test_batch_equals_per_tree():
    trees = [mixed_tree(), NestedSignal.from_nested([[vec(1), vec(2)], [vec(3)], vec(4)]),
             NestedSignal.join([mixed_tree((3, 2, 1, 0)), NestedSignal.from_nested([vec(9)])],
                               "keyvalue", keys=["doc", "z"])]
    enc = PositionEncoder(6, heads=2, graph_dim=4)
    each = torch.cat([enc(t) for t in trees])
    batch = Batch.from_data_list(trees)
    torch.testing.assert_close(enc(batch), each, atol=1e-5, rtol=0)


def test_gradients_reach_every_projection():
    tree = mixed_tree()
    enc = PositionEncoder(4, heads=2)
    pos = enc(tree)
    torch.manual_seed(0)
    q = k = v = torch.randn(tree.num_leaves, 2, 3)
    hsa_graph.hsa(q, k, v, tree, pos=pos).pow(2).sum().backward()
    for name, lin in enc.lins.items():
        assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0, name
    assert enc.field_names.weight.grad.abs().sum() > 0


def test_shared_raw_features_across_layers():
    tree = mixed_tree()
    first = PositionEncoder(4)
    second = PositionEncoder(4, field_names=first.field_names)
    features = first.features(tree)
    torch.testing.assert_close(second(tree, features), second(tree))
    assert second.field_names is first.field_names


def test_set_permutation_equivariance_holds_with_positions():
    enc = PositionEncoder(8, heads=2, dim=16)
    order = (3, 2, 0, 1)
    base, moved = mixed_tree(), mixed_tree(order)
    # set items as leaf rows of base: item 0 -> [r], 1 -> [r+1], 2 -> [r+2, r+3], 3 -> [r+4]
    r = 4 + 6
    rows = {0: [r], 1: [r + 1], 2: [r + 2, r + 3], 3: [r + 4]}
    perm = list(range(r)) + [j for i in order for j in rows[i]] + list(range(r + 5, 49))
    torch.manual_seed(1)
    q, k, v = (torch.randn(base.num_leaves, 2, 4) for _ in range(3))
    y0 = hsa_graph.hsa(q, k, v, base, pos=enc(base))
    y1 = hsa_graph.hsa(q[perm], k[perm], v[perm], moved, pos=enc(moved))
    torch.testing.assert_close(y1, y0[perm], atol=1e-5, rtol=1e-5)

    # the same move under a sequence parent is not equivariant: positions matter there
    def as_sequence(order):
        items = [vec(10), vec(11), [vec(12), vec(13)], vec(14)]
        return NestedSignal.from_nested({"title": [vec(i) for i in range(4)],
                                         "tags": [items[i] for i in order]})
    enc2 = PositionEncoder(8, heads=2, dim=16)
    s0, s1 = as_sequence((0, 1, 2, 3)), as_sequence(order)
    perm2 = [0, 1, 2, 3] + [j - 6 for i in order for j in rows[i]]
    q, k, v = q[:9], k[:9], v[:9]
    z0 = hsa_graph.hsa(q, k, v, s0, pos=enc2(s0))
    z1 = hsa_graph.hsa(q[perm2], k[perm2], v[perm2], s1, pos=enc2(s1))
    assert not torch.allclose(z1, z0[perm2], atol=1e-4)


def test_keyvalue_fields_in_any_order_give_the_same_outputs():
    enc = PositionEncoder(8, dim=16)
    a = NestedSignal.from_nested({"a": vec(0), "b": [vec(1), vec(2)], "c": vec(3)})
    b = NestedSignal.from_nested({"c": vec(3), "a": vec(0), "b": [vec(1), vec(2)]})
    torch.manual_seed(2)
    q, k, v = (torch.randn(4, 3) for _ in range(3))
    perm = [3, 0, 1, 2]  # rows of b in terms of a
    y_a = hsa_graph.hsa(q, k, v, a, pos=enc(a))
    y_b = hsa_graph.hsa(q[perm], k[perm], v[perm], b, pos=enc(b))
    torch.testing.assert_close(y_b, y_a[perm])


def test_encoder_repr_reset_and_errors():
    enc = PositionEncoder(4, heads=2, kind="sinusoidal", dim=8, graph="random_walk")
    assert repr(enc) == ("PositionEncoder(4, heads=2, dim=8, kind='sinusoidal', "
                         "graph='random_walk', graph_dim=8)")
    before = enc.lins["grid"].weight.clone()
    enc.reset_parameters()
    assert not torch.equal(before, enc.lins["grid"].weight)
    with pytest.raises(ValueError, match="multiple of 4"):
        PositionEncoder(4, kind="sinusoidal", dim=6)
    with pytest.raises(ValueError, match="graph must be"):
        PositionEncoder(4, graph="spectral")
    with pytest.raises(ValueError, match="out_dim"):
        PositionEncoder(0)
    with pytest.raises(TypeError, match="NestedSignal"):
        enc(torch.zeros(3))


def test_encoder_on_a_large_tree_is_fast():
    import time
    # 64 sentences of 64 tokens under 8 paragraphs: 4,169 nodes
    tree = NestedSignal.from_parents(
        torch.cat([torch.tensor([-1]), torch.zeros(8, dtype=torch.long),
                   torch.arange(1, 9).repeat_interleave(8),
                   torch.arange(9, 73).repeat_interleave(64)]))
    enc = PositionEncoder(16, heads=4)
    start = time.perf_counter()
    pos = enc(tree)
    assert time.perf_counter() - start < 10.0  # generous: CI machines are shared
    assert pos.shape == (tree.num_nodes, 4, 16)
    # tokens at the same index of different sentences share their encoding
    assert torch.equal(pos[73], pos[73 + 64])
