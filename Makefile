# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pytest processes for `make test`, one a core; a test file runs whole in one of them
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test check docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned, so the package's `torch>=2.3` is already met and no other build is pulled
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[harness,dev,integrations]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/accordion compare --task mnist1d --workers 2 --seeds 3 --no-progress \
		--strategies dense static:powersgd:4 static:powersgd:1 accordion:powersgd:4,1:paper \
		accordion:powersgd:4,2,1 static:topk:0.99 static:topk:0.01 \
		accordion:topk:0.99,0.01:paper accordion:topk:0.99,0.1,0.01 \
		static:int:8 static:int:4 accordion:mixed:int/8,int/4 \
		static:nq:3 accordion:mixed:nq/3,sparseloco/0.1,sparseloco/0.05,sparseloco/0.01 \
		diloco:10:lr=1:momentum=0+static:int:2 diloco:400:lr=1:momentum=0+static:int:4 \
		--baseline static:powersgd:4 static:topk:0.99 static:int:8 static:nq:3 --out runs/demo

test: $(STAMP)
	$(PY) -m ruff check src tests examples checks
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[harness,dev,integrations,docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)  # the site, strict: a broken link or a docstring warning fails it
	PY=$(PY) bash scripts/build_docs.sh

# The release checks, apart from `make test` to keep it under 10 minutes: the type check,
# checks/ (every example under its launcher, a loop killed under torchrun, the benchmark
# scripts end to end, the site in headless Chromium: Debian's `chromium`), and the wheel
# installed in a fresh venv outside the source tree.
check: docs
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider checks
	PYTHON=$(PYTHON) bash scripts/check_wheel.sh

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache site
