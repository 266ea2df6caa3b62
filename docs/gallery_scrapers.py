"""An image scraper for sphinx-gallery (named in ``docs/conf.py``) that shows the
figures of :mod:`hsa_graph.viz` in the tutorials.

``hsa_graph.viz`` builds its figures with :class:`matplotlib.figure.Figure` directly,
not through ``pyplot``, so sphinx-gallery's matplotlib scraper (which asks ``pyplot``
for its open figures) never sees them.
"""
from __future__ import annotations


def viz_figures(block, block_vars, gallery_conf) -> str:
    """Save every ``Figure`` that a tutorial's code block leaves in its globals and
    that no earlier block showed; return the reST that shows them after the block."""
    from matplotlib.figure import Figure
    from sphinx_gallery.scrapers import figure_rst

    figures = [value for value in block_vars["example_globals"].values()
               if isinstance(value, Figure) and not getattr(value, "_shown_in_docs", False)]
    paths = []
    for figure, path in zip(figures, block_vars["image_path_iterator"]):
        figure.savefig(path, dpi=100)
        figure._shown_in_docs = True     # a later block that keeps it shows nothing new
        paths.append(path)
    return figure_rst(paths, gallery_conf["src_dir"])
