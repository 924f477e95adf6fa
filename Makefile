# flashx-batch — `make help` lists the targets.
PY ?= .venv/bin/python
VENV ?= .venv
TORCH_CPU_WHEEL ?= torch==2.13.0
CONF ?= legal_docs

.PHONY: help setup run test test-fast bench lint doctor clean

help:  ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

setup:  ## create .venv; CPU build of torch unless an accelerator build is present, then the package + dev extras
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import torch" 2>/dev/null; then echo "torch already installed: keeping it"; \
	elif command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/kfd ] || [ -e /dev/davinci0 ]; then \
	  echo "accelerator found: pip resolves torch from the package's range (install a vendor build first to keep it)"; \
	else $(PY) -m pip install -q $(TORCH_CPU_WHEEL); fi
	$(PY) -m pip install -q -e '.[dev]'

run:  ## run the embedded default job (bundled sample + bundled tiny model); CONF=name for another preset
	$(PY) -m flashx_batch conf=$(CONF)

test:  ## the whole suite on two workers (CPU; GPU tests skip without a GPU; Ray / S3 / timing tests on one of them)
	$(PY) -m pytest -q -x -n 2 --dist loadgroup --durations=10

test-fast:  ## the edit loop (< 3 min): the suite without the slow tier (tests/conftest.py: SLOW_MODULES)
	$(PY) -m pytest -q -x -n 2 --dist loadgroup -m "not slow"

bench:  ## run the benchmarks, writing results/ (ratios measured side by side in one process)
	$(PY) -m flashx_batch.bench --out results/bench

lint:  ## ruff, and the layering contract (import-linter; pyproject.toml [tool.importlinter])
	$(PY) -m ruff check flashx_batch tests jobs
	$(VENV)/bin/lint-imports

doctor:  ## check the accelerator stack (torch build, drivers, CANN / ROCm, Ray) and name the fix
	$(PY) -m flashx_batch.doctor

clean:  ## remove build outputs (not the venv)
	rm -rf outputs multirun results build .pytest_cache
