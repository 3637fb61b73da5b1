# Everything a fresh machine needs: `make demo` and `make test` create .venv when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-scale test-real test-portable bench bench-smoke bench-env bench-fidelity bench-ekfac clean

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

# The suite on the built-in tiny models in one process. Two tiers run apart, both by CI after it (`.ci/run`), so that
# this one stays within its 15-minute budget on two cores (CI's machine took 990 s with the first in it):
# `make test-scale`, the random-weight real shapes (tests marked `scale`: attribute end to end on a SmolLM-135M-shaped
# model) and the multi-process tests (marked `ddp`: gloo processes under torchrun), and `make test-real`, the real
# pretrained models (tests marked `real`: SmolLM2-135M-Instruct and Gemma-3-270M, fetched once into GRADIAN_CACHE).
test: venv
	$(BIN)/python -m pytest tests -m "not real and not scale and not ddp"

test-scale: venv
	$(BIN)/python -m pytest tests -m "scale or ddp"

test-real: venv
	$(BIN)/python -m pytest tests -m real

# The suite under ATEN_CPU_CAPABILITY=default and avx2, each with a fresh GRADIAN_CACHE (see .ci/portable).
test-portable: venv
	PY=$(BIN)/python .ci/portable

bench: venv
	$(BIN)/python bench/index_bench.py --quick

# Every bench's smoke mode (`bench/NAME.py --smoke`, bench/_smoke.py): each script's own code path on the tiny model,
# two at a time, each ending with its JSON line (.ci/bench-smoke; CI runs it after `make test`). Not part of `make
# test`: it starts about forty Python processes (forked from one warm interpreter: about 85 CPU s in all).
bench-smoke: venv
	PY=$(BIN)/python .ci/bench-smoke

# Packages a bench needs that the project does not (kronfluence, for bench/ekfac_check.py), installed into the
# ignored .bench-env/ of this checkout, never into .venv: kronfluence's torchvision requirement would pull a
# torchvision that breaks transformers, so it goes in --no-deps with its pure-Python dependencies; the rest of what it
# imports (torch, accelerate, safetensors, tqdm) comes from .venv. bench/ekfac_check.py puts the directory on its path.
BENCH_ENV := .bench-env
KRON := $(BENCH_ENV)/kronfluence

bench-env: $(KRON)/.installed

$(KRON)/.installed: $(STAMP)
	rm -rf $(KRON)
	$(BIN)/pip install -q --no-deps --target $(KRON) kronfluence==1.0.1 einops==0.8.1 einconv==0.1.0 opt-einsum==3.4.0
	PYTHONPATH=$(KRON) $(BIN)/python -c "import kronfluence.analyzer, kronfluence.arguments, kronfluence.task"
	touch $@

# The two benches with their own documented budgets (bench/README.md), one torch thread each.
BENCH_THREADS := GRADIAN_THREADS=1 OMP_NUM_THREADS=1

bench-fidelity: venv
	$(BENCH_THREADS) $(BIN)/python bench/fidelity.py --quick

bench-ekfac: bench-env
	$(BENCH_THREADS) $(BIN)/python bench/ekfac_check.py

clean:
	rm -rf runs .pytest_cache
