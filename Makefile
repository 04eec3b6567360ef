# The README's commands. Everything installs into .venv from the pins in .ci/constraints.txt.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --constraint .ci/constraints.txt
STAMP  := $(VENV)/.installed
PYTEST := $(PY) -m pytest

.PHONY: lab test install model test-unit test-cuda test-notebooks bench-peers clean

## make lab: environment + default model, then JupyterLab on chapters/
lab: install model
	@echo "Starting JupyterLab on chapters/ (open the URL printed below; Ctrl-C stops it)"
	$(VENV)/bin/jupyter lab --notebook-dir=chapters --ServerApp.ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root)

## make test: the whole suite - unit tests, CUDA kernels under the simulator, every chapter notebook
test: install model test-unit test-cuda test-notebooks
	@echo "make test: all suites passed"

install: $(STAMP)

# Re-install only when the package description or the pins change.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PIP) -e ".[course,dev]"
	touch $(STAMP)

model: install
	$(VENV)/bin/minillm fetch

test-unit: install
	$(PYTEST) tests --ignore=tests/cuda

# The CUDA simulator must be switched on before numba is imported: a process of its own.
test-cuda: install
	@if ls tests/cuda/test_*.py >/dev/null 2>&1; then \
		NUMBA_ENABLE_CUDASIM=1 $(PYTEST) tests/cuda; \
	else echo "test-cuda: no CUDA tests yet"; fi

test-notebooks: install
	$(PYTEST) --nbval-lax --nbval-cell-timeout=900 chapters

# llama.cpp compiles from source (~9 minutes): only for the side-by-side benchmarks.
bench-peers: install
	$(PIP) -e ".[peers]"

clean:
	rm -rf $(VENV) .pytest_cache
