import pytest
import torch

from hsa_graph import hopping_window_forest
from hsa_graph.builders.text import split_sentences
from hsa_graph.pretrained import (
    check_hierarchy,
    resolve_hierarchy,
    semantic_hierarchy,
    token_mask,
    window_hierarchy,
)


def test_window_hierarchy_excludes_pads_any_side():
    right = window_hierarchy([[1, 1, 1, 1, 1, 0, 0], [1] * 7], (2, 2))
    left = window_hierarchy([[0, 0, 1, 1, 1, 1, 1], [1] * 7], (2, 2))
    expected = hopping_window_forest([5, 7], (2, 2))
    for forest in (right, left):
        assert torch.equal(forest.parent, expected.parent)
        assert torch.equal(forest.structure.leaf_tree, torch.tensor([0] * 5 + [1] * 7))


def test_flat_window_hierarchy_is_one_level():
    forest = window_hierarchy([[1, 1, 1, 0]], ())
    assert forest.parent.tolist() == [3, 3, 3, -1]


def _expected_parents(enc, texts, b):
    """Independent walk over one example: token -> (word, sentence) labels."""
    offsets = enc["offset_mapping"][b].tolist()
    spans = split_sentences(texts[b])
    labels = []
    for t, w in enumerate(enc.word_ids(b)):
        if not enc["attention_mask"][b, t]:
            continue
        if w is None:
            labels.append(None)
            continue
        start = offsets[t][0]
        sentence = max(i for i, (a, _) in enumerate(spans) if a <= start)
        labels.append((w, sentence))
    return labels


def test_semantic_hierarchy_matches_words_and_sentences(minilm, sentences):
    _, tokenizer = minilm
    texts = [sentences[0] + " it is unbelievably good . really .", sentences[3]]
    enc = tokenizer(texts, padding=True, return_offsets_mapping=True, return_tensors="pt")
    tree = semantic_hierarchy(enc, texts)
    parent = tree.parent
    n = int(enc["attention_mask"].sum())
    assert tree.num_leaves == n and tree.structure.num_trees == 2
    leaf = 0
    for b in range(2):
        labels = _expected_parents(enc, texts, b)
        leaves = list(range(leaf, leaf + len(labels)))
        leaf += len(labels)
        root = int(parent[parent[parent[leaves[1]]]])
        for u, label in zip(leaves, labels):
            if label is None:  # [CLS], [SEP]: children of the root
                assert int(parent[u]) == root
        # two tokens share a word node iff the tokenizer's word ids agree; a sentence
        # node iff split_sentences puts them in one sentence
        for u, lu in zip(leaves, labels):
            for v, lv in zip(leaves, labels):
                if lu is None or lv is None:
                    continue
                assert (parent[u] == parent[v]) == (lu == lv)
                assert (parent[parent[u]] == parent[parent[v]]) == (lu[1] == lv[1])
    # "unbelievably" is several word pieces under one word node
    pieces = tokenizer.tokenize("unbelievably")
    assert len(pieces) > 1
    # positions are reading order among siblings
    kids = (parent == root).nonzero().flatten()
    assert sorted(tree.position[kids, 0].tolist()) == list(range(kids.numel()))


def test_semantic_hierarchy_errors(minilm):
    _, tokenizer = minilm
    enc = tokenizer(["a b ."], return_tensors="pt")
    with pytest.raises(ValueError, match="offset_mapping"):
        semantic_hierarchy(enc, ["a b ."])
    enc = tokenizer(["a b ."], return_offsets_mapping=True, return_tensors="pt")
    with pytest.raises(ValueError, match="1 examples but 2 texts"):
        semantic_hierarchy(enc, ["a b .", "c"])
    with pytest.raises(TypeError, match="list of strings"):
        semantic_hierarchy(enc, "a b .")


def test_resolve_checks_the_forest_against_the_mask():
    mask = token_mask([[1, 1, 1, 0], [1, 1, 1, 1]])
    good = window_hierarchy([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert resolve_hierarchy(good, mask) is good
    with pytest.raises(ValueError, match="tree 0 of the hierarchy has 4 leaves"):
        resolve_hierarchy(window_hierarchy([[1, 1, 1, 1], [1, 1, 1, 0]]), mask)
    with pytest.raises(ValueError, match="1 trees but the batch has 2"):
        resolve_hierarchy(window_hierarchy([[1, 1, 1]]), mask)
    with pytest.raises(ValueError, match="semantic_hierarchy"):
        check_hierarchy("semantic")
    with pytest.raises(ValueError, match="must be >= 1"):
        check_hierarchy((2, 0))


def test_token_mask_errors():
    with pytest.raises(ValueError, match="example 1 has no tokens"):
        token_mask([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match=r"attention_mask\[0, 1\] = 2"):
        token_mask([[1, 2]])
    with pytest.raises(ValueError, match="batch, length"):
        token_mask([1, 1])


def test_induced_hierarchy_checks_and_builds():
    from hsa_graph.pretrained import InducedHierarchy, SparsePattern, check_hierarchy

    for bad, match in (({"max_children": 1}, "max_children"),
                       ({"max_children": True}, "max_children"),
                       ({"method": "random"}, "method"), ({"pool": "max"}, "pool")):
        with pytest.raises(ValueError, match=match):
            InducedHierarchy(**{"max_children": 4, **bad})
    assert check_hierarchy(InducedHierarchy(4)) is None
    assert check_hierarchy(SparsePattern("local", 2)) is None
    mask = torch.tensor([[True] * 5 + [False], [True] * 6])
    with pytest.raises(ValueError, match="induced:4 is built inside each layer"):
        resolve_hierarchy(InducedHierarchy(4), mask)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(11, 2, 3, generator=g)
    batch = torch.tensor([0] * 5 + [1] * 6)
    for method in ("contiguous", "cluster"):
        tree = InducedHierarchy(2, method).build(keys, batch)
        st = tree.structure
        assert st.num_trees == 2 and torch.equal(st.leaf_tree, batch)
        assert int(st._family_sizes.max()) <= 2
    with pytest.raises(ValueError, match="keys must be"):
        InducedHierarchy(2).build(keys[0, 0], batch)
