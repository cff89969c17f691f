# make repro: the full comparison (dvc repro, a SIGTERM passed on to it); make test: lint and tests; make demo: the CPU demo.
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install repro demo test lint postgres mlflow-ui bench gpu-check gpu-validate

# A driver too old for the pinned torch's CUDA: install torch from a package index for an older CUDA, e.g.
#   rm -rf .venv && make install TORCH_INDEX=https://download.pytorch.org/whl/cu126
# with TORCH_PAIR a torch/torchvision pair that index holds (the default: the pinned pair).
TORCH_INDEX ?=
TORCH_PAIR ?= torch==2.14.1 torchvision==0.29.1

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	python3 -m venv $(VENV)
ifdef TORCH_INDEX
	$(PY) -m pip install -q --index-url $(TORCH_INDEX) $(TORCH_PAIR)
	grep -vE '^(torch|torchvision)==' requirements.txt > $(VENV)/requirements-without-torch.txt
	$(PY) -m pip install -q -r $(VENV)/requirements-without-torch.txt -r requirements-dev.txt
else
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
endif
	$(PY) -m pip install -q --no-deps -e .
	touch $@

# `dvc plots show`'s page with vega, vega-lite and vega-embed inline, so plots draw offline: made from the pinned
# vl-convert-python, not committed, and named in this checkout's own DVC config (.dvc/config.local), so a checkout
# without it keeps DVC's default page
PLOTS_PAGE := .dvc/plots.html
$(PLOTS_PAGE): $(VENV)/.installed
	$(PY) -m ampbench.report.dvc_template $@
	$(VENV)/bin/dvc config --local plots.html_template plots.html

install: $(VENV)/.installed $(PLOTS_PAGE)

repro: install
	ampbench repro

demo: install
	ampbench demo

lint: install
	ruff check .

# The team test runs an mlflow server on a throwaway PostgreSQL cluster: Debian's postgresql, installed here when it
# is missing and this runs as root with apt-get (CI); elsewhere the test skips and says why.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's postgresql for the team test"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null || \
		{ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; }; \
	else echo "note: no PostgreSQL here (apt-get install postgresql): the team test skips"; fi

test: lint postgres
	pytest

mlflow-ui: install
	ampbench mlflow-ui --port 5000

bench: install
	python benchmarks/overhead.py

gpu-check: install
	python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json

# Needs a GPU, torch with its torchvision, pyyaml, tqdm, psutil, numpy; no DVC, MLflow or install step.
gpu-validate:
	PYTHONPATH=src python3 benchmarks/gpu_validate.py --out benchmarks/results/gpu_validate
