#!/usr/bin/env bash
# Build the documentation site into site/ in strict mode: any warning (a broken link or
# anchor, a missing snippet file, a docstring griffe cannot parse) fails the build.
# Needs the `docs` extra: .venv/bin/pip install -e ".[docs]"
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
export NO_MKDOCS_2_WARNING=1  # the banner about MkDocs 2.0, not a warning about this site
"$PY" -m mkdocs build --strict --clean "$@"
