# Two commands do all set-up on a fresh machine:
#   make demo   -- create .venv, install, and run the main job on the embedded default
#   make test   -- create .venv, install, lint, type-check and run the test suite
# `make test` runs the tests not marked `slow`; `make test-slow` the slow tier (real multi-process
# gloo runs, the zoo's scripts, large traces: each over ~10 s). CI (.ci/run) runs both, then
# `make test-torch214`: the whole suite (both tiers) on torch 2.14.1 (the CUDA build a plain
# `pip install torch` gives), in its own venv (~6 GB).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VENV214 := .venv-torch214
STAMP214 := $(VENV214)/.installed
# the dev/test set-up's exact versions (a fresh clone tests what CI passed with)
CONSTRAINTS := requirements/dev-constraints.txt
# libraries only the zoo's scripts see (tests/zoo): installed apart, put on their path only
ZOODEPS := .zoo-deps
# the quantisation libraries whose real layers tests/test_quant_formats.py compares with (child process only)
QUANTDEPS := .quant-deps
# torchtitan and what its trainer imports, for tests/test_torchtitan.py (its runs' path only)
TITANDEPS := .titan-deps

.PHONY: demo test test-slow test-noextras test-torch214 test-latest lint typecheck bench clean install

$(STAMP): pyproject.toml $(CONSTRAINTS) requirements/zoo.txt requirements/quant.txt requirements/titan.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 CPU wheel lies on this machine's disk; the package supports torch>=2.13 (README)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	$(BIN)/pip install -q --no-deps --upgrade --target $(ZOODEPS) -r requirements/zoo.txt
	$(BIN)/pip install -q --no-deps --upgrade --target $(QUANTDEPS) -r requirements/quant.txt
	$(BIN)/pip install -q --no-deps --upgrade --target $(TITANDEPS) -r requirements/titan.txt
	touch $(STAMP)

# The same install with torch 2.14.1 (non-reentrant checkpoint moved its generator there).
$(STAMP214): pyproject.toml $(CONSTRAINTS) requirements/quant.txt requirements/titan.txt
	$(PY) -m venv $(VENV214)
	$(VENV214)/bin/pip install -q --upgrade pip
	$(VENV214)/bin/pip install -q torch==2.14.1
	$(VENV214)/bin/pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	$(VENV214)/bin/pip install -q --no-deps --upgrade --target $(ZOODEPS) -r requirements/zoo.txt
	$(VENV214)/bin/pip install -q --no-deps --upgrade --target $(QUANTDEPS) -r requirements/quant.txt
	$(VENV214)/bin/pip install -q --no-deps --upgrade --target $(TITANDEPS) -r requirements/titan.txt
	touch $(STAMP214)

install: $(STAMP)

# The compiled core of the allocator's replay (setup.py; src/vramplan/allocator/core.py), rebuilt
# when its sources change: the package never runs a build older than its source (it falls back
# to the Python source, and tests/test_allocator_core.py says so), so a test run rebuilds first.
CORE := src/vramplan/allocator/_core_build.json
CORESRC := src/vramplan/allocator/fused.py src/vramplan/allocator/blocks.py src/vramplan/allocator/_keyset.c setup.py
$(CORE): $(CORESRC) | $(STAMP)
	$(BIN)/pip install -q --no-deps -e .
	touch $(CORE)

# The report ends with its answer: the question, the verdict and the change that makes it fit,
# confirmed by a trace of that change.
demo: $(STAMP)
	$(BIN)/vramplan estimate llama-3.1-8b --task train --precision bf16-mixed --optimizer adamw \
	    --batch 4 --seq 2048 --checkpointing full --gpu h100-sxm

test: $(STAMP) $(CORE)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/pytest -n 2 -p no:cacheprovider -m "not slow"

# The slow tier (tests marked `slow`); CI runs it after `make test`.
test-slow: $(STAMP) $(CORE)
	$(BIN)/pytest -n 2 -p no:cacheprovider -m slow

# Only the suite: ruff and mypy ran in `make test` (mypy is also clean on 2.14.1, but a cold
# mypy over torch's annotations adds minutes for little: behaviour differences show in tests).
test-torch214: $(STAMP214)
	$(VENV214)/bin/pytest -n 2 -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/estimate_speed.py
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/replay_speed.py
	$(BIN)/python bench/trace_speed.py
	$(BIN)/python bench/plan_speed.py
	$(BIN)/python bench/accum_speed.py

clean:
	rm -rf $(VENV) $(VENV214) .venv-latest $(ZOODEPS) $(QUANTDEPS) build dist src/*.egg-info src/*.so src/vramplan/allocator/*.so $(CORE)

# The newest releases of accelerate, transformers, peft, trl and lightning against the framework
# tests, each alone on the pinned set and all together; reports which break (never fails).
test-latest:
	PY=$(PY) bash .ci/latest.sh

# A plain `pip install .` (no extras) in a fresh venv answers the main commands without a
# traceback (issue 14). CI runs it after `make test`.
test-noextras:
	PY=$(PY) bash .ci/no_extras.sh
