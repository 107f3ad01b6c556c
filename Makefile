# `make run` and `make test` work on a fresh clone: they create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= models/tiny-glm-moe

.PHONY: run test venv clean-venv

$(BIN)/metrale: pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first: the local CPU build, so pip never pulls a CUDA build for the range in pyproject.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

venv: $(BIN)/metrale

run: venv
	$(BIN)/python tools/run_main.py --model $(MODEL)

test: venv
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q tests

clean-venv:
	rm -rf $(VENV)
