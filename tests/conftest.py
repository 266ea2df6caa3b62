"""Make the helper modules in tests/ (reference.py, hsa_trees.py) importable from any
test file, wherever pytest is started."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# One intra-op thread: the suite's tensors are small, and on a 2-core CI machine (or
# next to the DDP test's worker processes) extra threads only wait for each other.
import torch  # noqa: E402

torch.set_num_threads(1)
