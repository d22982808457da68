"""The library stays readable: no class over 300 lines and no function over 60 in src/.

Lines are counted from the ``def``/``class`` line to the last line of the body,
docstrings and comments included (``end_lineno - lineno + 1``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "accordion"
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60


def _definitions(kinds: tuple[type, ...]) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every definition of ``kinds`` under ``SRC``."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, kinds):
                lines = node.end_lineno - node.lineno + 1
                found.append((lines, f"{path.relative_to(SRC)}:{node.lineno} {node.name}"))
    return found


def test_the_size_check_sees_the_librarys_classes_and_functions():
    # a walk that found nothing would pass the checks below without checking anything
    assert any("Controller" in name for _, name in _definitions((ast.ClassDef,)))
    assert len(_definitions((ast.FunctionDef,))) > 500


def test_no_class_in_the_library_is_over_300_lines():
    long = sorted((n, name) for n, name in _definitions((ast.ClassDef,)) if n > MAX_CLASS_LINES)
    assert long == [], f"classes over {MAX_CLASS_LINES} lines: {long}"


def test_no_function_in_the_library_is_over_60_lines():
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    long = sorted((n, name) for n, name in _definitions(kinds) if n > MAX_FUNCTION_LINES)
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: {long}"
