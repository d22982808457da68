"""Specification of the top-level public API: ``import accordion`` and its version."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

import accordion
import accordion.ddp
import accordion.policy

#: The names a user needs, as the module docstring documents them.
DOCUMENTED = [
    "AccordionState",
    "AdamNoiseCorrection",
    "AllocationRule",
    "AuditRule",
    "Checkpointer",
    "Controller",
    "DiLoCo",
    "FSDPState",
    "GuardedRule",
    "Ladder",
    "MomentumExchange",
    "Observation",
    "PaperRule",
    "Rule",
    "Schedule",
    "StreamingDiLoCo",
    "__version__",
    "accordion_hook",
    "calibrate",
    "compressor_names",
    "layer_plan",
    "make_compressor",
    "make_plan",
    "scaling_plan",
    "summarize",
]

#: Prefixes of modules that ``import accordion`` must leave unimported.
NOT_IMPORTED = (
    "accordion.integrations",
    "accordion.harness",
    "accordion.cluster",
    "lightning",
    "accelerate",
    "transformers",
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` in a fresh interpreter, capturing its text output."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_every_name_in_all_exists_on_the_module():
    missing = [name for name in accordion.__all__ if not hasattr(accordion, name)]
    assert missing == []


def test_all_holds_the_documented_names():
    assert sorted(accordion.__all__) == sorted(DOCUMENTED)


def test_import_accordion_imports_no_integration_harness_cluster_or_framework():
    code = (
        "import sys, accordion; "
        f"print(sorted(m for m in sys.modules for p in {NOT_IMPORTED!r} "
        "if m == p or m.startswith(p + '.')))"
    )
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_integrations_attribute_resolves_lazily_to_the_integrations_package():
    # a fresh process: here another test may have imported the package already
    code = (
        "import sys, accordion; "
        "print('accordion.integrations' in sys.modules); "
        "print(accordion.integrations is sys.modules['accordion.integrations'])"
    )
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_top_level_names_are_the_objects_of_their_modules():
    assert accordion.AccordionState is accordion.ddp.AccordionState
    assert accordion.PaperRule is accordion.policy.PaperRule


def test_accordion_version_prints_the_package_and_distribution_version():
    out = _run("-m", "accordion", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"accordion {accordion.__version__}"
    assert accordion.__version__ == importlib.metadata.version("torch-accordion")


def test_the_py_typed_marker_is_in_the_installed_package():
    assert (Path(accordion.__file__).parent / "py.typed").is_file()


def test_an_unknown_attribute_raises_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_name"):
        accordion.no_such_name  # noqa: B018
