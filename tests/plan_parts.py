"""Running ``accordion plan`` in-process for the plan's tests."""

from __future__ import annotations

import json

import pytest

from accordion.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    """Run ``accordion plan --json ARGV`` in-process and parse its one JSON object."""
    assert main(["plan", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def run_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``accordion plan ARGV`` in-process and return what it printed."""
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out
