# make repro: the full comparison (dvc repro); make test: lint and tests; make demo: the CPU demo.
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install repro demo test lint mlflow-ui bench gpu-check

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

install: $(VENV)/.installed

repro: install
	dvc repro

demo: install
	ampbench demo

lint: install
	ruff check .

test: lint
	pytest

mlflow-ui: install
	ampbench mlflow-ui --port 5000

bench: install
	python benchmarks/overhead.py

gpu-check: install
	python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json
