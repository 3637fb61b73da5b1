# Everything a fresh machine needs: `make demo` and `make test` create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-portable bench clean

venv: $(STAMP)

# torch first and pinned: a loose `torch` resolved by pip pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: venv
	$(BIN)/gradian demo --out runs/demo

test: venv
	$(BIN)/python -m pytest tests

# The suite under ATEN_CPU_CAPABILITY=default and avx2, each with a fresh GRADIAN_CACHE (see .ci/portable).
test-portable: venv
	PY=$(BIN)/python .ci/portable

bench: venv
	$(BIN)/python bench/index_bench.py --quick

clean:
	rm -rf runs .pytest_cache
