# The README's commands. Everything installs into .venv from the pins in .ci/constraints.txt.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --constraint .ci/constraints.txt
STAMP  := $(VENV)/.installed
# -X faulthandler: a crash while the interpreter exits (seen once in three suite runs here, after every
# test had passed; Ray Serve leaves a daemon event-loop thread behind) prints every thread's stack.
PYTEST := $(PY) -X faulthandler -m pytest

.PHONY: lab test install model browser test-unit test-cuda test-notebooks notebooks bench-peers clean

## make lab: environment + default model, then JupyterLab on chapters/
lab: install model
	@echo "Starting JupyterLab on chapters/ (open the URL printed below; Ctrl-C stops it)"
	$(VENV)/bin/jupyter lab --notebook-dir=chapters --ServerApp.ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root)

## make test: the whole suite - unit tests, CUDA kernels under the simulator, every chapter notebook
# The simulator runs every GPU thread as a Python thread, so it holds one core (the GIL): it runs
# beside the notebooks, each target's output printed whole when it ends (-O). A clean clone on a 2-core
# AMD EPYC Zen 5 VM (fresh .venv, empty Numba cache; the host stealing <1% of the CPU): 23.4 min in
# all - unit tests 11.4 (two processes; 27.2 in one), then CUDA 7.2 beside the notebooks' 10.8.
test: install model browser test-unit
	$(MAKE) --no-print-directory -j2 -O test-cuda test-notebooks
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

## make browser: what tests/test_chat_page.py drives - Playwright's Python package (pinned) and Debian's
## chromium as its browser (apt-get, as root, only when missing; Playwright's own browser download is not used).
## Without a browser the test skips and says why.
BROWSER_STAMP := $(VENV)/.browser
browser: $(BROWSER_STAMP)

$(BROWSER_STAMP): $(STAMP)
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium \
				|| echo "make browser: apt-get could not install chromium; the chat-page test will skip"; \
		else echo "make browser: no chromium (install Debian's 'chromium' as root); the chat-page test will skip"; fi; }
	$(PIP) playwright
	touch $(BROWSER_STAMP)

# Two processes (pytest-xdist), a test file at a time each (its module fixtures - a model, a server,
# a Ray cluster of its own - set up once). From an empty Numba cache about half of one process's time
# is compiling, one kernel variant at a time on one core: the second process keeps the other core busy.
test-unit: install
	$(PYTEST) -n 2 --dist loadfile tests --ignore=tests/cuda

# The CUDA simulator must be switched on before numba is imported: a process of its own.
test-cuda: install
	@if ls tests/cuda/test_*.py >/dev/null 2>&1; then \
		NUMBA_ENABLE_CUDASIM=1 $(PYTEST) tests/cuda; \
	else echo "test-cuda: no CUDA tests yet"; fi

# Chapter 00 prints course.progress(): the notebooks run on an empty ledger of their own, so that
# neither CI nor committed outputs read or change the learner's ($MINILLM_PROGRESS, see minillm/course/ledger.py).
FRESH_LEDGER := ledger=$$(mktemp -d) && trap 'rm -rf "$$ledger"' EXIT && export MINILLM_PROGRESS="$$ledger/progress.json"

test-notebooks: install
	$(FRESH_LEDGER) && $(PYTEST) --nbval-lax --nbval-cell-timeout=900 chapters

## make notebooks: re-execute every chapter in place, in order, so that the committed outputs come
## from the code as it is (tests/test_course.py compares each notebook's printed fingerprint)
# The python3 kernel is .venv's own (jupyter runs from it); the cell timeout is test-notebooks'.
notebooks: install
	$(FRESH_LEDGER) && $(foreach nb,$(sort $(wildcard chapters/[0-9]*.ipynb)),$(VENV)/bin/jupyter nbconvert --to notebook --execute \
		--inplace --ExecutePreprocessor.kernel_name=python3 --ExecutePreprocessor.timeout=900 $(nb) && ) true

# llama.cpp compiles from source (~9 minutes): only for the side-by-side benchmarks. Its AVX2-only
# build, for `benchmarks/decode.py --isa avx2`, is `benchmarks/build_peers.sh avx2` (another 9 minutes).
bench-peers: install
	benchmarks/build_peers.sh native

clean:
	rm -rf $(VENV) .pytest_cache
