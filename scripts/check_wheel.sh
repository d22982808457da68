#!/usr/bin/env bash
# Build the sdist and wheel of torch-accordion, check what they hold, and install the wheel
# into a fresh venv, then run the package from outside the source tree: the import, the
# `accordion` command, `accordion plan` and (when it exists) examples/cost_model.py.
#
#   scripts/check_wheel.sh            # from the repository root; PYTHON=python3.12 for another
#
# Needs network access to PyPI (or a pip cache / find-links) for build, twine, setuptools
# (the isolated build env), numpy and torch==2.13.0. Everything goes to a temp dir, removed
# on exit; nothing is written to the source tree except the egg-info setuptools makes
# under src/ when it builds the sdist (ignored by git).
set -euo pipefail

PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/check_wheel.XXXXXX")
TORCH_PID=
cleanup() {
  # stop the background torch install if the script ends before waiting on it
  if [[ -n $TORCH_PID ]]; then kill "$TORCH_PID" 2>/dev/null || true; wait "$TORCH_PID" 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT

START=$SECONDS
step() { printf '\n== %s  [%ds]\n' "$*" $((SECONDS - START)); }
fail() { printf 'check_wheel: FAIL: %s\n' "$*" >&2; exit 1; }
quiet() {  # run a command, showing its output only when it fails
  local log="$TMP/last.log"
  "$@" >"$log" 2>&1 || { cat "$log" >&2; fail "$*"; }
}

# the version as the source writes it (read here, at build time, only to compare)
VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' src/accordion/_version.py)
[[ -n $VERSION ]] || fail "no __version__ in src/accordion/_version.py"

step "fresh venv for the wheel, torch==2.13.0 into it in the background, with $("$PYTHON" --version 2>&1)"
quiet "$PYTHON" -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
# torch first and pinned, so the wheel's torch>=2.3 is already met (no other build pulled);
# --no-compile: byte-compiling all of torch is most of the install's time
"$VPY" -m pip install --no-compile torch==2.13.0 >"$TMP/torch.log" 2>&1 &
TORCH_PID=$!

step "tools venv (build, twine)"
quiet "$PYTHON" -m venv "$TMP/tools"
TOOLS="$TMP/tools/bin/python"
quiet "$TOOLS" -m pip install --no-compile build twine

step "build sdist and wheel (the wheel from the sdist)"
quiet "$TOOLS" -m build --outdir "$TMP/dist" .
shopt -s nullglob
sdists=("$TMP"/dist/torch_accordion-"$VERSION".tar.gz)
wheels=("$TMP"/dist/torch_accordion-"$VERSION"-py3-none-any.whl)
shopt -u nullglob
[[ ${#sdists[@]} -eq 1 && ${#wheels[@]} -eq 1 ]] \
  || fail "expected one sdist and one wheel of $VERSION, got: $(ls "$TMP/dist")"
SDIST=${sdists[0]}
WHEEL=${wheels[0]}
ls -l "$TMP/dist"

step "twine check"
"$TOOLS" -m twine check --strict "$SDIST" "$WHEEL"

step "contents of the sdist and the wheel"
"$TOOLS" - "$SDIST" "$WHEEL" <<'EOF'
import os
import sys
import tarfile
import zipfile

sdist, wheel = sys.argv[1:]
errors = []

with tarfile.open(sdist) as tar:
    # strip the leading "torch_accordion-X.Y.Z/"
    names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
for need in ("pyproject.toml", "README.md", "PKG-INFO", "src/accordion/__init__.py",
             "src/accordion/_version.py", "src/accordion/py.typed"):
    if need not in names:
        errors.append(f"sdist lacks {need}")
for bad in (".venv/", ".git/", "runs/", "docs/results/", "build/", "dist/", "__pycache__/"):
    hits = sorted(n for n in names if n.startswith(bad) or f"/{bad}" in f"/{n}")
    if hits:
        errors.append(f"sdist holds {bad}: {hits[:3]}")
print(f"sdist: {len(names)} files, {os.path.getsize(sdist) / 1024:.1f} KB")

with zipfile.ZipFile(wheel) as zf:
    wnames = zf.namelist()
    entry_points = next((zf.read(n).decode() for n in wnames
                         if n.endswith(".dist-info/entry_points.txt")), "")
if "accordion/py.typed" not in wnames:
    errors.append("wheel lacks accordion/py.typed")
for bad in ("tests/", "docs/", "benchmarks/", "examples/", "scripts/", "runs/"):
    hits = [n for n in wnames if n.startswith(bad) or f"/{bad}" in n]
    if hits:
        errors.append(f"wheel holds {bad}: {hits[:3]}")
tops = sorted({n.split("/", 1)[0] for n in wnames})
strays = [t for t in tops if t != "accordion" and not t.endswith(".dist-info")]
if strays:
    errors.append(f"wheel installs top-level names other than accordion: {strays}")
if "accordion = accordion.cli:main" not in entry_points:
    errors.append(f"wheel's entry_points.txt lacks the accordion script: {entry_points!r}")
caches = [n for n in wnames if "__pycache__" in n or n.endswith(".pyc")]
if caches:
    errors.append(f"wheel holds compiled files: {caches[:3]}")
print(f"wheel: {len(wnames)} files, top level {tops}")
print(f"wheel size: {os.path.getsize(wheel) / 1024:.1f} KB ({os.path.basename(wheel)})")

if errors:
    print("\n".join(errors), file=sys.stderr)
    sys.exit(1)
EOF

step "the wheel into the fresh venv (no extras: plan needs none), once torch is in"
wait "$TORCH_PID" || { cat "$TMP/torch.log" >&2; TORCH_PID=; fail "pip install torch==2.13.0"; }
TORCH_PID=
grep -E "^Successfully installed|already satisfied: torch" "$TMP/torch.log" || true
quiet "$VPY" -m pip install "$WHEEL"
"$VPY" -c "import torch; print('torch', torch.__version__)"
"$VPY" -m pip check

# from here on: outside the source tree, with nothing of it on the path
mkdir "$TMP/run"
cd "$TMP/run"
unset PYTHONPATH
# let the first import cache torch's bytecode (pip installed it with --no-compile)
unset PYTHONDONTWRITEBYTECODE
export PATH="$TMP/venv/bin:$PATH"
[[ $(command -v accordion) == "$TMP/venv/bin/accordion" ]] || fail "accordion is $(command -v accordion)"

step "import accordion from the venv"
"$VPY" - "$REPO" "$VERSION" <<'EOF'
import os
import sys
import sysconfig

import accordion

repo, version = sys.argv[1:]
where = os.path.realpath(accordion.__file__)
site = os.path.realpath(sysconfig.get_paths()["purelib"])
print(accordion.__version__, where)
assert accordion.__version__ == version, (accordion.__version__, version)
assert where.startswith(site + os.sep), f"accordion imported from {where}, not {site}"
assert not where.startswith(os.path.realpath(repo) + os.sep), f"imported from the source tree"
assert os.path.isfile(os.path.join(os.path.dirname(where), "py.typed")), "py.typed not installed"
EOF

step "accordion --version / --help"
out=$(accordion --version)
echo "$out"
[[ $out == "accordion $VERSION" ]] || fail "accordion --version printed '$out'"
accordion --help >"$TMP/help.txt"
grep -q "plan" "$TMP/help.txt" || fail "accordion --help names no plan subcommand"
accordion plan --help >/dev/null

step "accordion plan (tables, a scaling grid, --json)"
accordion plan --model resnet18 --compressor powersgd --workers 4
accordion plan --model resnet50 --compressor topk --workers 8,64 --bandwidth 10Gbit,100Gbit \
  --latency 5us
accordion plan --model resnet18 --compressor topk --workers 8 --layers --json >"$TMP/plan.json"
"$VPY" - "$TMP/plan.json" <<'EOF'
import json
import sys

plan = json.load(open(sys.argv[1]))
assert plan["model"] == "resnet18" and plan["workers"] == 8, plan
labels = [level["label"] for level in plan["levels"]]
assert labels[0] == "dense" and len(labels) >= 2, labels
assert plan["layers"] and plan["topk_break_even"]["workers"] == 8, plan.keys()
print(f"plan --json: {plan['parameters']} parameters, levels {labels}")
EOF

if [[ -f $REPO/examples/cost_model.py ]]; then
  step "examples/cost_model.py (a copy, run outside the tree)"
  cp "$REPO/examples/cost_model.py" "$TMP/run/"
  "$VPY" cost_model.py >"$TMP/cost_model.log" 2>&1 || { cat "$TMP/cost_model.log"; fail "cost_model.py"; }
  tail -n 5 "$TMP/cost_model.log"
else
  step "examples/cost_model.py: not there, skipped"
fi

step "all checks passed"
