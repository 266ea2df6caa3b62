"""``python -m hsa_graph``: the ``hsa-graph`` command line (:mod:`hsa_graph.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
