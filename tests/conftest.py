"""Make the helper modules in tests/ (reference.py, hsa_trees.py) importable from any
test file, wherever pytest is started."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
