"""Shared fixtures: the real pre-trained MiniLM (loaded once) and real Pang & Lee text."""
import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def minilm():
    from hsa_graph.pretrained import load_minilm
    return load_minilm()


@pytest.fixture(scope="session")
def sentences():
    from network_data import pang_lee_sentences as load_pang_lee_sentences
    data = load_pang_lee_sentences()
    # short and long ones, both labels: a padded batch with real length spread
    picked = [data[i][0] for i in (0, 1, 2, 2000, 2001, 2002)]
    return picked
