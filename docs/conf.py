"""Sphinx configuration of the hsa_graph documentation.

Build (from the repository root, offline; warnings are errors)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
    python -m sphinx -W --keep-going -b doctest docs docs/_build/doctest

The API reference is generated here, at configuration time, from the ``__all__`` of
every public module: each public name is documented once, under the highest package
that exports it (``hsa_graph.hsa``, not ``hsa_graph.ops.hsa.hsa``), so no public name
can be left out. The tutorials in ``docs/tutorials`` are scripts that sphinx-gallery
runs at every build; a tutorial that raises fails the build.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")       # the packaged MiniLM: never ask the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import hsa_graph  # noqa: E402

project = "hsa_graph"
author = "the hsa_graph authors"
copyright = "the hsa_graph authors"
release = version = hsa_graph.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.doctest",
    "sphinx_gallery.gen_gallery",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "figures/*.md", "tutorials/README.rst",
                    "tutorials_gen/*.py", "tutorials_gen/*.ipynb", "tutorials_gen/*.zip"]
templates_path: list = []
html_theme = "alabaster"
html_static_path: list = []
html_theme_options = {"description": "Hierarchical Self-Attention on nested signals",
                      "page_width": "1100px", "sidebar_width": "230px"}
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]   # the README's first heading is an h1 inside a page

autodoc_default_options = {"show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True      # NamedTuple fields: one entry each, not two

# The docs' own ``.. doctest::`` blocks run with ``-b doctest``; the ``>>>`` examples of
# the docstrings run (with their module's globals) in tests/test_doctests.py.
doctest_test_doctest_blocks = ""
doctest_global_setup = """
import torch
import hsa_graph
torch.manual_seed(0)
"""

sphinx_gallery_conf = {
    "examples_dirs": "tutorials",
    "gallery_dirs": "tutorials_gen",
    "filename_pattern": r"tutorial_",        # every tutorial runs at build time
    "abort_on_example_error": True,
    "download_all_examples": False,
    "write_computation_times": False,
    "remove_config_comments": True,
    "within_subsection_order": "FileNameSortKey",
    "image_scrapers": ("matplotlib",),
    "reset_modules": ("matplotlib",),
}


# ----------------------------------------------------------------- API reference
def _public_modules():
    yield "hsa_graph"
    for _, name, _ in pkgutil.walk_packages(hsa_graph.__path__, "hsa_graph."):
        if not any(part.startswith("_") for part in name.split(".")):
            yield name


def api_homes():
    """``{module: [names]}``: each public name under the highest module exporting it."""
    modules = sorted(_public_modules(), key=lambda m: (m.count("."), m))
    homes: dict = {m: [] for m in modules}
    seen: dict = {}
    for name in modules:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if isinstance(obj, type(sys)):
                continue                          # a submodule: it has its own page
            if callable(obj):
                # a function or class re-exported further down has its entry here already
                key = (getattr(obj, "__module__", name), getattr(obj, "__qualname__", attr))
                if key not in seen:
                    seen[key] = name
                    homes[name].append(attr)
            else:
                # a constant lives where it is defined (its ``#:`` comment is read there):
                # the deepest module that exports it
                previous = seen.get(id(obj))
                if previous is not None:
                    homes[previous[0]].remove(previous[1])
                seen[id(obj)] = (name, attr)
                homes[name].append(attr)
    return homes


def _write_api() -> None:
    out = DOCS / "api" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for module, names in api_homes().items():
        path = out / f"{module}.rst"
        wanted.add(path.name)
        title = f"``{module}``"
        lines = [title, "=" * len(title), "", f".. automodule:: {module}"]
        if names:
            lines += [f"   :members: {', '.join(names)}", "   :imported-members:"]
        else:
            lines += ["   :no-members:"]
        text = "\n".join(lines) + "\n"
        if not path.exists() or path.read_text() != text:   # keep mtimes for incremental builds
            path.write_text(text)
    for stale in out.glob("*.rst"):
        if stale.name not in wanted:
            stale.unlink()


_write_api()


def _check_api(app, env) -> None:
    """Fail the build (a warning under -W) if a public name has no entry."""
    from sphinx.util import logging

    objects = env.get_domain("py").objects
    for module, names in api_homes().items():
        for name in names:
            if f"{module}.{name}" not in objects:
                logging.getLogger(__name__).warning(
                    f"public name {module}.{name} is missing from the API reference")


def setup(app):
    app.connect("env-check-consistency", _check_api)
