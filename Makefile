# Two commands for a fresh machine: `make serve` and `make test`.
# TORCH_SPEC pins the CPU build that lies on disk on the project's machines;
# on a CUDA host run e.g. `make serve TORCH_SPEC=torch` (pip's arguments: an
# --index-url may follow the requirement).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/smollm2.yaml
PORT ?=
PYTEST_ARGS ?=

.PHONY: install serve fetch test clean

$(VENV)/.installed: pyproject.toml Makefile
	@echo "==> creating $(VENV) and installing (torch: $(TORCH_SPEC))"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar on $(foreach w,$(TORCH_SPEC),'$(w)')
	$(PY) -m pip install --progress-bar on -e ".[test]"
	touch $@

install: $(VENV)/.installed

fetch: install
	$(PY) -m mstar_actors fetch smollm2

serve: fetch
	$(PY) -m mstar_actors serve $(CONFIG) $(if $(PORT),--port $(PORT))

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
