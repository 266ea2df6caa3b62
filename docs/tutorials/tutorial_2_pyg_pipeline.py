"""
HSA in a PyG pipeline with a GNN
================================

Nested signals are PyG ``Data`` objects, so trees batch into forests with PyG's own
tools, and an HSA encoder plugs in front of any GNN. Here: 15 real HTML manual pages
(libffi, libxslt and Node.js, stored in ``tests/data/html``) become page trees; an HSA
encoder turns each page into one vector; a ``GCNConv`` over the pages' hyperlink graph
classifies which manual a page belongs to, trained end to end.

Fifteen pages are far too few to measure generalisation: this tutorial shows the wiring
(batching, pooling, a GNN on top, gradients reaching HSA), not a benchmark.
``examples/pyg_pipeline.py`` runs the same design on the 1,500 Pang & Lee reviews.
"""

# %%
# Pages -> trees, and the hyperlink graph
# ---------------------------------------
# :func:`~hsa_graph.html_tree` makes one tree per page (sections, paragraphs,
# sentences, words); ``embed`` maps the page's tokens to ids, hashed into 4,096 buckets
# for a learnt embedding table. :func:`~hsa_graph.website_tree` reads the hyperlinks:
# its root is a ``graph`` family with one child per page and ``sibling_edge_index``
# holding the links between those children.
from pathlib import Path

import torch
from torch_geometric.data import Batch
from torch_geometric.nn import GCNConv
from torch_geometric.utils import to_undirected

from hsa_graph import html_tree, website_tree
from hsa_graph.builders import hash_tokens
from hsa_graph.nn import HierarchicalTransformerEncoder, global_leaf_pool

ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "tests" / "data").is_dir())
BUCKETS = 4096
pages = {str(path.relative_to(ROOT / "tests" / "data" / "html")): path.read_text()
         for path in sorted((ROOT / "tests" / "data" / "html").glob("*/*.html"))}
manuals = sorted({url.split("/")[0] for url in pages})
labels = torch.tensor([manuals.index(url.split("/")[0]) for url in pages])


def embed(tokens):
    return hash_tokens(tokens) % BUCKETS


trees = [html_tree(html, embed=embed, max_children=64) for html in pages.values()]
site = website_tree(pages, embed=embed, max_children=64)
page_root = (site.parent == 0).nonzero().flatten()          # node id of each page's root
page_of = torch.full((site.num_nodes,), -1, dtype=torch.long)
page_of[page_root] = torch.arange(len(pages))
edge_index = to_undirected(page_of[site.sibling_edge_index])
print(f"{len(pages)} pages of {manuals}, {sum(t.num_leaves for t in trees):,} tokens, "
      f"{edge_index.shape[1] // 2} links")

# %%
# The model: embedding -> HSA encoder -> one vector per page -> GCN
# -----------------------------------------------------------------
# ``Batch.from_data_list`` makes one forest of all pages; attention never crosses
# trees, and :func:`~hsa_graph.nn.global_leaf_pool` returns one row per tree.


class PageClassifier(torch.nn.Module):
    def __init__(self, channels: int = 32, classes: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(BUCKETS, channels)
        self.encoder = HierarchicalTransformerEncoder(channels, num_layers=1, heads=2,
                                                      layer="hte")
        self.gcn = GCNConv(channels, classes)

    def forward(self, forest, edge_index):
        leaves = self.encoder(self.embed(forest.x), forest)   # [N, C], HSA inside each page
        pages = global_leaf_pool(leaves, forest)               # [pages, C]
        return self.gcn(pages, edge_index)                     # [pages, classes]


torch.manual_seed(0)
forest = Batch.from_data_list(trees)
model = PageClassifier(classes=len(manuals))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

# %%
# Training end to end
# -------------------
# The GNN's loss back-propagates through the pooling into the HSA layer and the token
# embeddings.
for step in range(30):
    optimizer.zero_grad()
    logits = model(forest, edge_index)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    if step == 0:
        first_loss = loss.item()
        grads = [p.grad for p in model.encoder.parameters() if p.grad is not None]
        print(f"step 0: {len(grads)} tensors of the HSA encoder received gradients "
              f"(largest |grad| {max(g.abs().max().item() for g in grads):.1e})")
    optimizer.step()
accuracy = (logits.argmax(-1) == labels).float().mean().item()
print(f"loss {first_loss:.3f} -> {loss.item():.3f}; accuracy on the (training) pages "
      f"{accuracy:.2f}")
assert loss.item() < first_loss
