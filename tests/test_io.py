"""hsa_graph.io: every attribute round-trips, batches come back batched, model weights
load with weights_only, and damaged, tampered or hostile files raise ValueError
without running any code."""
from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from matplotlib import cbook
from PIL import Image
from torch_geometric.data import Batch

import hsa_graph
from hsa_graph import NestedSignal, Node, hsa
from hsa_graph.builders import (
    WordTokenizer,
    document_tree,
    html_tree,
    image_tree,
    text_tree,
    text_trees,
)
from hsa_graph.io import load, save
from hsa_graph.nn import HierarchicalTransformerEncoder

LIBFFI = os.path.join(os.path.dirname(__file__), "data", "html", "libffi", "Introduction.html")


def assert_same_tree(a: NestedSignal, b: NestedSignal) -> None:
    assert type(b) is type(a) or (isinstance(a, Batch) and isinstance(b, Batch))
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        va, vb = a[name], b[name]
        if isinstance(va, torch.Tensor):
            assert isinstance(vb, torch.Tensor), name
            assert va.dtype == vb.dtype and va.shape == vb.shape, name
            assert torch.equal(va, vb) or (va.is_floating_point() and torch.equal(
                va.isnan(), vb.isnan()) and torch.equal(va.nan_to_num(), vb.nan_to_num())), name
        else:
            assert va == vb, name


def trees():
    """Real builders' trees: text (tokens, span), an HTML page, a picture's
    quadtree, a key-value document with a graph and a set, a hand-made forest."""
    with cbook.get_sample_data("grace_hopper.jpg") as handle:
        picture = np.asarray(Image.open(handle).convert("RGB"))[::8, ::8]
    with open(LIBFFI, encoding="utf-8") as f:
        page = html_tree(f.read())
    doc = NestedSignal.from_nested({
        "title": [torch.randn(4), torch.randn(4)],
        "links": Node([torch.randn(4), torch.randn(4), torch.randn(4)], geometry="graph",
                      edges=[(0, 1), (2, 0)], modality=2),
        "tags": Node([torch.randn(4), torch.randn(4)], geometry="set"),
    })
    forest = NestedSignal.from_parents([-1, 0, 0, -1, 3, 3, 3], x=torch.arange(5),
                                       modality=[1, 1, 1, 0, 0, 0, 0])
    return {
        "text": text_tree("It rained. We stayed in.\n\nThe sun came out!"),
        "html": page,
        "image": image_tree(picture, 16, quadtree=True),
        "document": doc,
        "forest": forest,
        "float16": NestedSignal.from_parents([-1, 0, 0], x=torch.randn(2, 3).half()),
        "bfloat16_nan": NestedSignal.from_parents(
            [-1, 0, 0], x=torch.tensor([[float("nan"), 1.0], [float("inf"), -2.0]]).bfloat16()),
        "no_x": NestedSignal.from_parents([-1, 0, 0, 1, 1]),
        "single_node": NestedSignal.from_parents([-1], x=torch.ones(1, 2)),
    }


@pytest.mark.parametrize("name", sorted(trees()))
def test_tree_round_trip(name, tmp_path):
    tree = trees()[name]
    save(tree, tmp_path / "t.pt")
    back = load(tmp_path / "t.pt")
    assert_same_tree(tree, back)
    assert back.structure.num_leaves == tree.num_leaves


def test_document_tree_keys_and_modalities_round_trip(tmp_path):
    doc = document_tree({"headline": "Grace Hopper retires.",
                         "body": ["She wrote the first compiler.", "COBOL followed."]},
                        text=text_tree)
    save(doc, tmp_path / "doc.pt")
    back = load(tmp_path / "doc.pt")
    assert back.key == doc.key and "headline" in back.key
    assert torch.equal(back.modality, doc.modality)


def test_batch_round_trip_keeps_batch_vectors_and_outputs(tmp_path):
    batch = text_trees(["One. Two.", "Three four five.\n\nSix!", "Seven."])
    save(batch, tmp_path / "b.pt")
    back = load(tmp_path / "b.pt")
    assert isinstance(back, Batch) and back.num_graphs == 3
    for name in ("batch", "ptr", "edge_index", "x", "geometry", "position", "modality", "span"):
        assert torch.equal(back[name], batch[name]), name
    assert back.tokens == batch.tokens and back.key == batch.key
    assert {k: v.tolist() for k, v in back._slice_dict.items()} == \
        {k: v.tolist() for k, v in batch._slice_dict.items()}
    for a, b in zip(batch.to_data_list(), back.to_data_list()):
        assert_same_tree(a, b)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, batch.num_leaves, 2, 4).unbind(0)
    assert torch.equal(hsa(q, k, v, batch), hsa(q, k, v, back))


def test_mixed_batch_with_sibling_edges(tmp_path):
    t = trees()
    batch = Batch.from_data_list([t["document"], t["document"], t["single_node"].clone()
                                  .update({"x": torch.ones(1, 4)})])
    save(batch, tmp_path / "b.pt")
    back = load(tmp_path / "b.pt")
    assert torch.equal(back.sibling_edge_index, batch.sibling_edge_index)
    assert back.sibling_edge_index.shape[1] == 4
    assert torch.equal(back.batch, batch.batch) and back.key == batch.key


def test_model_state_dict_weights_only_round_trip(tmp_path):
    torch.manual_seed(0)
    model = HierarchicalTransformerEncoder(16, num_layers=2, heads=2, pos_dim=4)
    tree = text_tree("A model saved. Then loaded!", tokenizer=WordTokenizer(num_buckets=64),
                     embed=torch.nn.Embedding(64, 16))
    x = tree.x.detach()
    # the plain PyTorch route, as users would do it
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    state = torch.load(tmp_path / "plain.pt", weights_only=True)
    # and through hsa_graph.io (with a digest)
    save(model.state_dict(), tmp_path / "io.pt")
    checked = load(tmp_path / "io.pt")
    for loaded in (state, checked):
        other = HierarchicalTransformerEncoder(16, num_layers=2, heads=2, pos_dim=4)
        other.load_state_dict(loaded)
        model.eval(), other.eval()
        assert torch.equal(model(x, tree), other(x, tree))
    with pytest.raises(TypeError, match="state_dict"):
        save(model, tmp_path / "module.pt")


def test_tampered_model_file_fails_cleanly(tmp_path):
    model = HierarchicalTransformerEncoder(8, num_layers=1, heads=2)
    save(model.state_dict(), tmp_path / "m.pt")
    data = bytearray((tmp_path / "m.pt").read_bytes())
    # a byte inside the weights: find the first tensor's raw bytes in the archive
    weight = next(iter(model.state_dict().values()))
    at = bytes(data).find(weight.numpy().tobytes()[:16])
    assert at > 0
    data[at + 3] ^= 0x40
    (tmp_path / "m.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="modified|not a readable"):
        load(tmp_path / "m.pt")


def test_every_flipped_byte_is_rejected_or_harmless(tmp_path):
    """Flip bytes all over the file: each load raises ValueError or gives back exactly
    the saved tree (bytes in zip padding carry nothing); never another tree or a crash."""
    tree = text_tree("Flip me. Then load me!")
    path = tmp_path / "t.pt"
    save(tree, path)
    data = path.read_bytes()
    rejected = 0
    for at in range(0, len(data), max(1, len(data) // 160)):
        damaged = bytearray(data)
        damaged[at] ^= 0xA5
        path.write_bytes(bytes(damaged))
        try:
            back = load(path)
        except ValueError:
            rejected += 1
            continue
        assert_same_tree(tree, back)
    assert rejected > 40


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.999])
def test_truncated_file(tmp_path, fraction):
    path = tmp_path / "t.pt"
    save(text_tree("Cut short."), path)
    os.truncate(path, int(os.path.getsize(path) * fraction))
    with pytest.raises(ValueError, match="not a readable"):
        load(path)


class _Exploit:
    """Unpickling this would create a directory: the proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_pickled_code_is_never_run(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "evil.pt"
    torch.save({"format": "hsa_graph.io", "version": 1, "kind": "tree",
                "content": _Exploit(marker)}, path)
    with pytest.raises(ValueError, match="needs code to load|not a readable"):
        load(path)
    assert not os.path.exists(marker)
    with open(path, "wb") as f:  # a bare pickle, not even a torch archive
        pickle.dump(_Exploit(marker), f)
    with pytest.raises(ValueError):
        load(path)
    assert not os.path.exists(marker)


def forged(kind, content, **overrides):
    """A payload with a correct digest: what an attacker who knows the format writes."""
    payload = {"format": "hsa_graph.io", "version": 1, "kind": kind, "content": content}
    payload["sha256"] = hsa_graph.io._digest(kind, content)
    payload.update(overrides)
    return payload


def good_content():
    return hsa_graph.io._tree_content(text_tree("A b."), "the tree")


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(parent=torch.tensor([1, 2, 0, 0, 0, 0, 0])), "cycle"),
    (lambda c: c.update(parent=torch.tensor([-1, 0, 1, 2, 2, 9, 2])), "out of range"),
    (lambda c: c.update(parent=[-1, 0, 1]), "expected a tensor"),
    (lambda c: c.update(x=torch.arange(2)), "one row per leaf"),
    (lambda c: c.update(x="ids"), "expected a tensor"),
    (lambda c: c.update(geometry=torch.full((7,), 9)), "geometry"),
    (lambda c: c.update(key=[1] * 7), "key"),
    (lambda c: c.update(modality=torch.full((7,), -3)), "modality"),
    (lambda c: c.update(sibling_edge_index=torch.tensor([[3], [4]])), "not 'graph'"),
    (lambda c: c.pop("extras"), "expected the fields"),
])
def test_forged_invalid_trees_are_rejected(tmp_path, change, match):
    content = good_content()
    change(content)
    torch.save(forged("tree", content), tmp_path / "f.pt")
    with pytest.raises(ValueError, match=match):
        load(tmp_path / "f.pt")


@pytest.mark.parametrize("payload, match", [
    ({"weights": torch.ones(2)}, "not written by hsa_graph.io"),
    ([1, 2, 3], "not written by hsa_graph.io"),
    (forged("tree", good_content(), version=99), "version 99"),
    (forged("pickle", good_content()), "unknown kind"),
    (forged("batch", []), "non-empty list"),
    (dict(forged("state_dict", {}), content={1: torch.ones(1)}), "malformed"),
    (forged("state_dict", [torch.ones(1)]), "str keys"),
    (forged("tree", good_content(), sha256="0" * 64), "modified"),
])
def test_wrong_files_are_rejected(tmp_path, payload, match):
    torch.save(payload, tmp_path / "w.pt")
    with pytest.raises(ValueError, match=match):
        load(tmp_path / "w.pt")


def test_unsaveable_attributes_are_named(tmp_path):
    tree = text_tree("Fine.")
    tree.tokenizer = object()
    with pytest.raises(TypeError, match="'tokenizer'"):
        save(tree, tmp_path / "t.pt")
    with pytest.raises(TypeError, match="cannot save a str"):
        save("tree", tmp_path / "t.pt")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.pt")


# ------------------------------------------------------------ issue 17: hostile files
def _forged(path, content, kind="tree", digest=None, **header):
    """A file laid out as save writes it, with ``content`` (and its true digest, which
    is public: it detects damage, not forgery) or any header fields."""
    from hsa_graph.io import FORMAT, VERSION, _digest
    payload = {"format": FORMAT, "version": VERSION, "kind": kind, "content": content}
    payload["sha256"] = digest if digest is not None else _digest(kind, content)
    payload.update(header)
    torch.save(payload, path)


def _content(tree):
    from hsa_graph.io import _tree_content
    return _tree_content(tree, "the tree")


def test_expanded_tensor_is_refused_before_any_allocation(tmp_path):
    content = _content(NestedSignal.from_parents([-1, 0]))
    content["extras"]["huge"] = torch.zeros(1).expand(2 ** 40)   # 4 TiB once contiguous
    path = tmp_path / "bomb.pt"
    _forged(path, content, digest="0" * 64)
    assert os.path.getsize(path) < 4096
    with pytest.raises(ValueError, match=r"view over a storage of 4 bytes \(expanded"):
        load(path)


@pytest.mark.parametrize("kind", ["sparse", "meta", "nested", "shared"])
def test_tensors_save_never_writes_are_refused(tmp_path, kind):
    content = _content(NestedSignal.from_parents([-1, 0, 0], x=torch.ones(2, 3)))
    if kind == "sparse":
        content["x"] = torch.ones(2, 3).to_sparse()
    elif kind == "meta":
        content["x"] = torch.empty(2, 3, device="meta")
    elif kind == "nested":
        content["extras"]["ragged"] = torch.nested.nested_tensor([torch.ones(2),
                                                                  torch.ones(3)])
    else:
        content["extras"]["alias"] = content["x"]
    path = tmp_path / f"{kind}.pt"
    _forged(path, content, digest="0" * 64)
    with pytest.raises(ValueError):
        load(path)


def test_a_flipped_bit_that_torch_asserts_on_is_a_value_error(tmp_path):
    """Byte 261, bit 0 of this file once raised ``AssertionError: saved_id must be a
    tuple`` from inside torch.load; every single-bit flip of the pickle's header is
    either refused with ValueError or harmless."""
    tree = text_tree("Flip me.")
    path = tmp_path / "t.pt"
    save(tree, path)
    data = path.read_bytes()
    rejected = 0
    for at in range(200, 330):
        damaged = bytearray(data)
        damaged[at] ^= 1
        path.write_bytes(bytes(damaged))
        try:
            back = load(path)
        except ValueError:
            rejected += 1
            continue
        assert torch.equal(back.parent, tree.parent) and back.tokens == tree.tokens
    assert rejected > 10


def test_deeply_nested_header_value_is_described_not_recursed(tmp_path):
    import sys
    deep = []
    for _ in range(5000):
        deep = [deep]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)   # only for writing the forged file
    try:
        _forged(tmp_path / "v.pt", {}, digest="0", version=deep)
        _forged(tmp_path / "k.pt", {}, kind=deep, digest="0")
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(ValueError, match="format version <a list>"):
        load(tmp_path / "v.pt")
    with pytest.raises(ValueError, match="unknown kind <a list>"):
        load(tmp_path / "k.pt")


def test_forged_batch_content_is_named_not_a_pyg_error(tmp_path):
    a = _content(text_tree("One. Two."))
    b = _content(NestedSignal.from_parents([-1, 0, 0], x=torch.ones(2, 3)))
    _forged(tmp_path / "b.pt", [a, b], kind="batch")
    with pytest.raises(ValueError, match="the saved trees do not form a batch: trees 0 and 1"):
        load(tmp_path / "b.pt")


@pytest.mark.parametrize("name", ["structure", "batch", "ptr", "edge_index", "to", "_cache"])
def test_reserved_extra_names_are_refused_at_load(tmp_path, name):
    content = _content(NestedSignal.from_parents([-1, 0, 0]))
    content["extras"][name] = torch.tensor([1, 2, 3])
    _forged(tmp_path / "r.pt", content)
    with pytest.raises(ValueError, match=f"attribute name '{name}'"):
        load(tmp_path / "r.pt")


def test_compressed_archive_is_refused(tmp_path):
    import zipfile
    path = tmp_path / "t.pt"
    save(text_tree("Zip me."), path)
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(packed, "w",
                                                          zipfile.ZIP_DEFLATED) as out:
        for info in source.infolist():
            out.writestr(info.filename, source.read(info))
    with pytest.raises(ValueError, match="compressed entry"):
        load(packed)
