# Opake developer commands. Each target creates (or reuses) the virtual environment in $(VENV) and installs what
# it needs. TORCH_SPEC pins the torch build: the default is a CPU build; set TORCH_SPEC=torch for your platform's.
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.opake-installed
PYTEST_WORKERS ?= 2

.PHONY: demo test lint docs bench install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,docs,demo,hf,trl]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/opake demo --output-dir demo_output

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir site
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check opake_core opake_torch tests benchmarks

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) benchmarks/noise_throughput.py
	$(PY) benchmarks/harness.py --suite gpu --out bench_results --profile --steps 8 --warmup 3

clean:
	rm -rf site demo_output .pytest_cache .ruff_cache
