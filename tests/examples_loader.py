"""Import a script of ``examples/`` as a module, for the tests of that example."""
from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@contextmanager
def example_module(filename: str) -> Iterator[ModuleType]:
    """``examples/<filename>`` loaded as a module (registered in ``sys.modules`` while
    the context lasts, so dataclasses and pickling inside it work)."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(filename).stem}",
                                                  EXAMPLES / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
