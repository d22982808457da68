# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

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
		--baseline static:powersgd:4 static:topk:0.99 --out runs/demo

test: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
