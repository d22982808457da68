"""Load a script of benchmarks/ (no package) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(relative: str):
    """``benchmarks/<relative>`` imported under its stem; its ``main()`` does not run."""
    path = BENCHMARKS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
