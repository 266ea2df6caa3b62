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
sys.path.insert(0, str(DOCS))      # gallery_scrapers (by name: the config stays picklable)
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
    # hsa_graph.viz builds figures without pyplot: docs/gallery_scrapers.py shows them
    "image_scrapers": ("matplotlib", "gallery_scrapers.viz_figures"),
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


def _home_index() -> dict:
    """Each documented object -> its entry (``module.name``): callables by where they
    are defined, constants by identity and name."""
    index = {}
    for module, names in api_homes().items():
        for attr in names:
            index[_object_key(getattr(importlib.import_module(module), attr), attr)] = \
                f"{module}.{attr}"
    return index


def _object_key(obj, attr: str):
    if callable(obj) and hasattr(obj, "__qualname__"):
        return ("callable", getattr(obj, "__module__", None), obj.__qualname__)
    return ("constant", id(obj), attr)


def _object_at(path: str):
    """The object at a dotted path under an imported module, or ``None``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        obj = sys.modules.get(".".join(parts[:cut]))
        if obj is None:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj
    return None


def _find_home(path: str, index: dict):
    """``hsa_graph.a.b.Name.member`` -> the entry of ``Name`` (plus ``.member``)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj = getattr(module, parts[cut], None)
        if obj is None or isinstance(obj, type(sys)):
            return None
        home = index.get(_object_key(obj, parts[cut]))
        if home is None or _object_at(path) is None:
            return None
        return ".".join([home, *parts[cut + 1:]])
    return None


def _defining_modules(node) -> list:
    """The modules defining what the docstring holding ``node`` documents (the page
    may document it under a re-exporting package, where its short names mean nothing)."""
    from sphinx.util.nodes import get_node_source

    found = []
    documented = []
    if node.get("py:module") and node.get("py:class"):
        documented.append(f"{node['py:module']}.{node['py:class']}")
    try:
        source = get_node_source(node) or ""
    except Exception:  # noqa: BLE001 - a node without a source: nothing to add
        source = ""
    if ":docstring of " in source:
        documented.append(source.split(":docstring of ", 1)[1])
    for path in documented:
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            obj = _object_at(".".join(parts[:cut]))
            name = obj.__name__ if isinstance(obj, type(sys)) else getattr(obj, "__module__",
                                                                           None)
            if isinstance(name, str) and name.startswith("hsa_graph"):
                found.append(name)
                break
    return found


def _resolve_moved(app, env, node, contnode):
    """Resolve a reference to a public name by the path of its defining module, or by
    a short name in a docstring shown under a re-exporting package: both lead to the
    one entry of the object (under its highest exporting package)."""
    if node.get("refdomain") != "py":
        return None
    from sphinx.util.nodes import make_refnode

    if not hasattr(env, "_hsa_graph_homes"):
        env._hsa_graph_homes = _home_index()
    target = node["reftarget"].lstrip(".~")
    contexts = [""]
    if node.get("py:module"):
        contexts.append(node["py:module"] + ".")
        if node.get("py:class"):
            contexts.append(f"{node['py:module']}.{node['py:class']}.")
    contexts += [module + "." for module in _defining_modules(node)]
    objects = env.get_domain("py").objects
    for context in contexts:
        full = context + target
        if not full.startswith("hsa_graph."):
            continue
        home = _find_home(full, env._hsa_graph_homes)
        if home is not None and home in objects:
            entry = objects[home]
            return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id,
                                contnode, home)
    return None


def setup(app):
    app.connect("env-check-consistency", _check_api)
    app.connect("missing-reference", _resolve_moved)
