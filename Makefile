# `make run` and `make test` work on a fresh clone: they create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= models/tiny-glm-moe

# `make gpu-check` on a machine with a GPU: the cuda tests, the Triton kernels against the paths they
# replace and metrale bench, one table, four small files under GPU_CHECK_OUT (cells.jsonl grows as
# each cell finishes), all within 9 minutes. It uses .venv when there is one, else the machine's
# python3 (with torch built for CUDA, transformers, triton if present and the project's small
# dependencies; no Ray); it runs from the checkout, never installs anything, never builds the
# native CPU library, and writes the ~2 GB random checkpoint under the temporary folder.
GPU_CHECK_OUT ?= gpu-check-out
GPU_PY ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo $(PY))
# pytest-xdist workers for `make test` (0: one process). Two on two cores: much of the suite waits on
# child processes, servers and collectives; each worker's torch takes half the cores (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: run test venv clean-venv gpu-check

$(BIN)/metrale: pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first: the local CPU build, so pip never pulls a CUDA build for the range in pyproject.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# The native CPU ops (runtime/ops/cpu_ops.py), built once here rather than on the first step; without
	# a C++ compiler the Python paths run (slower; the same values within rounding).
	$(BIN)/python -m runtime.ops.cpu_ops || echo "native CPU ops not built: the Python paths will run"
	@touch $@

venv: $(BIN)/metrale

run: venv
	$(BIN)/python tools/run_main.py --model $(MODEL)

test: venv
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

gpu-check:
	$(GPU_PY) tools/gpu_check.py --out-dir $(GPU_CHECK_OUT)

clean-venv:
	rm -rf $(VENV)
